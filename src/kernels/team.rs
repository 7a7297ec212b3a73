//! One team of threads for a whole decode step.
//!
//! A decode step is a few hundred small parallel jobs (each matrix-vector product, each
//! layer's attention), each 10–100 µs of work. Handing every one of them to a thread
//! pool that has gone to sleep costs a wake-up per job (a futex, and in a VM an
//! interrupt between vCPUs), which is as long as the job itself. The team's workers
//! instead spin on a job counter between jobs, so starting a job costs one cache-line
//! transfer; after [`SPIN`] without work they sleep on a condition variable, so an idle
//! process does not keep cores busy.
//!
//! A job is `n` tasks and a function of the task index; the caller and the workers take
//! task indices from one atomic counter (uneven tasks and a preempted vCPU balance out)
//! and the caller returns once every task has run. Which thread runs a task never changes
//! its result: tasks write disjoint outputs.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: longer than the gaps inside a step and
/// than a sampling step between two decode calls, short enough not to matter when idle.
const SPIN: Duration = Duration::from_millis(2);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// The current job, published by the caller: a pointer to its task function (valid until
/// every worker has reported done) and the task count.
struct Job {
    task: Option<*const Task<'static>>,
    tasks: usize,
}

struct Shared {
    /// Incremented once per job; a worker runs a job when it sees a new value.
    epoch: AtomicUsize,
    job: Mutex<Job>,
    /// The next task index to take.
    next: AtomicUsize,
    /// Workers that have not yet finished the current job.
    pending: AtomicUsize,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    panicked: AtomicBool,
    shutdown: AtomicBool,
}

// SAFETY: the raw task pointer is only dereferenced while the caller of `run` is blocked
// waiting for the job, which keeps the function alive; the function itself is `Sync`.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

pub struct Team {
    shared: Arc<Shared>,
    workers: usize,
    /// One job at a time (several Python threads may run models at once).
    busy: Mutex<()>,
}

thread_local! {
    /// Set on team workers and on a caller inside `run`: a nested `run` runs inline.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
}

impl Team {
    /// A team of `threads` threads: the caller and `threads - 1` workers.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: Mutex::new(Job { task: None, tasks: 0 }),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let workers = threads.max(1) - 1;
        for i in 0..workers {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("kvcandle-team-{}", i + 1))
                .spawn(move || worker(&s))
                .expect("cannot start a kvcandle worker thread");
        }
        Self { shared, workers, busy: Mutex::new(()) }
    }

    /// The process-wide team, sized by the thread count candle uses (RAYON_NUM_THREADS,
    /// which kvcandle's Python module sets to the physical core count).
    pub fn global() -> &'static Team {
        static TEAM: OnceLock<Team> = OnceLock::new();
        TEAM.get_or_init(|| Team::new(candle_core::utils::get_num_threads()))
    }

    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `task(i)` for every `i < tasks` on the team and returns when all have run.
    /// A panic in a task is raised again here, after every thread has stopped.
    pub fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.workers == 0 || tasks == 1 || IN_TEAM.with(Cell::get) {
            (0..tasks).for_each(task);
            return;
        }
        let _one_job = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        {
            let mut job = s.job.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: erasing the lifetime; the pointer is used only until `pending`
            // reaches zero below, while `task` is still borrowed by this call.
            job.task = Some(unsafe { std::mem::transmute::<*const Task<'_>, *const Task<'static>>(task as *const Task<'_>) });
            job.tasks = tasks;
        }
        s.next.store(0, Ordering::Relaxed);
        s.pending.store(self.workers, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        IN_TEAM.with(|f| f.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, tasks, task)));
        IN_TEAM.with(|f| f.set(false));
        if mine.is_err() {
            // stop the others taking tasks, then wait for them
            s.next.store(usize::MAX / 2, Ordering::Relaxed);
        }
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        let worker_panicked = s.panicked.swap(false, Ordering::Relaxed);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if worker_panicked {
            panic!("a task panicked on a kvcandle worker thread");
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        let _g = self.shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.wake.notify_all();
    }
}

fn take_tasks(s: &Shared, tasks: usize, task: &Task<'_>) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        task(i);
    }
}

fn worker(s: &Shared) {
    IN_TEAM.with(|f| f.set(true));
    // the epoch the team was made with: a job published before this thread started
    // still counts as new
    let mut seen = 0;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(1024) {
                std::hint::spin_loop();
                continue;
            }
            if since.elapsed() < SPIN {
                continue;
            }
            let mut g = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            since = Instant::now();
        }
        let (task, tasks) = {
            let job = s.job.lock().unwrap_or_else(|p| p.into_inner());
            (job.task, job.tasks)
        };
        if let Some(task) = task {
            // SAFETY: the caller of `run` keeps the task alive until `pending` is zero.
            let task = unsafe { &*task };
            if catch_unwind(AssertUnwindSafe(|| take_tasks(s, tasks, task))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
                s.next.store(usize::MAX / 2, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

/// A mutable slice that tasks write disjoint parts of.
pub struct Shards<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: tasks only touch disjoint ranges (the caller's contract on `part`).
unsafe impl<T: Send> Sync for Shards<'_, T> {}

impl<'a, T> Shards<'a, T> {
    pub fn new(data: &'a mut [T]) -> Self {
        Self { ptr: data.as_mut_ptr(), len: data.len(), _life: std::marker::PhantomData }
    }

    /// The start of the data, for tasks writing strided blocks (a raw pointer: no two
    /// tasks hold overlapping slices).
    pub fn as_mut_ptr(&self) -> *mut T {
        self.ptr
    }

    /// `data[range]`.
    ///
    /// # Safety
    /// No two live results may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "shard {range:?} outside 0..{}", self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let team = Team::new(3);
        for tasks in [0, 1, 2, 7, 1000] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            team.run(tasks, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn wakes_after_sleeping_and_survives_a_panic() {
        let team = Team::new(2);
        std::thread::sleep(SPIN * 3);
        let mut out = vec![0usize; 64];
        let shards = Shards::new(&mut out);
        team.run(64, &|i| unsafe { shards.part(i..i + 1)[0] = i * 2 });
        assert_eq!(out, (0..64).map(|i| i * 2).collect::<Vec<_>>());
        let r = catch_unwind(AssertUnwindSafe(|| team.run(16, &|i| assert!(i != 9, "task nine"))));
        assert!(r.is_err());
        let sum = AtomicUsize::new(0);
        team.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }
}
