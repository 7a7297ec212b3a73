//! SentencePiece BPE ("llama" GGUF vocabularies: Llama 1/2, TinyLlama, Mistral) encoded
//! and decoded as SentencePiece itself does, from the pieces, scores and types a GGUF file
//! holds (llama.cpp's converter writes them from `tokenizer.model`).
//!
//! Encoding (SentencePiece's `Normalizer::Normalize` with the identity rule, then
//! `bpe::Model::Encode`, then `PopulateSentencePieceText`):
//! - a text that is not empty gets the dummy prefix "▁" when the vocabulary asks for it,
//!   whatever it begins with (so " Hello" is "▁▁Hello"), and every ' ' becomes "▁";
//! - every character is a symbol, except user-defined pieces, which are matched whole
//!   (longest first) and never merged;
//! - the adjacent pair whose concatenation is a piece (normal, user-defined or unused)
//!   with the highest score is merged, the leftmost among equal scores, until none is left;
//! - a result that is an unused piece is split back into the pieces it was merged from;
//!   a symbol that is no piece becomes its UTF-8 bytes' pieces (`<0xE4>`) where the
//!   vocabulary has them, else the unknown piece (runs of unknowns fused into one).
//!
//! With special tokens parsed (`parse_special`), the text is first cut at the control
//! and unknown pieces written in it (longest first, as llama.cpp does), and each piece of
//! text between them is encoded as above, on its own: what llama.cpp and Meta's own Llama
//! code do (each segment gets its dummy prefix).
//!
//! Decoding is SentencePiece's `Decode`: byte pieces are joined and read as UTF-8 (each
//! byte that does not start a valid character is U+FFFD), "▁" is a space, the first
//! piece's leading "▁" is dropped (the dummy prefix), control pieces are invisible and the
//! unknown piece reads " ⁇ ". Writing special tokens (`skip_special = false`) shows control
//! and unknown pieces as their text, and the text after each starts anew (its dummy
//! prefix dropped): the inverse of encoding with special tokens parsed.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Error, Result};

/// The "▁" that stands for a space.
const SPACE: char = '\u{2581}';
/// What SentencePiece writes for the unknown piece (`kDefaultUnknownSymbol`).
const UNKNOWN_SURFACE: &str = " \u{2047} ";

/// A piece's type, numbered as SentencePiece's `ModelProto` and GGUF's
/// `tokenizer.ggml.token_type` number them (0, undefined, reads as normal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl PieceKind {
    pub fn from_number(n: i64) -> Option<Self> {
        Some(match n {
            0 | 1 => PieceKind::Normal,
            2 => PieceKind::Unknown,
            3 => PieceKind::Control,
            4 => PieceKind::UserDefined,
            5 => PieceKind::Unused,
            6 => PieceKind::Byte,
            _ => return None,
        })
    }

    /// Pieces BPE may produce (SentencePiece's `pieces_`); the others are reserved.
    fn mergeable(self) -> bool {
        matches!(self, PieceKind::Normal | PieceKind::UserDefined | PieceKind::Unused)
    }

    /// Pieces written in a text that become their ids when special tokens are parsed.
    fn special(self) -> bool {
        matches!(self, PieceKind::Control | PieceKind::Unknown)
    }
}

/// The byte a piece `<0xAB>` stands for.
pub fn byte_of_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

pub struct SentencePiece {
    pieces: Vec<String>,
    kinds: Vec<PieceKind>,
    scores: Vec<f32>,
    /// normal, user-defined and unused pieces (what a merge may produce)
    mergeable: HashMap<String, u32>,
    /// control, unknown and byte pieces (looked up first, as SentencePiece's `PieceToId`)
    reserved: HashMap<String, u32>,
    /// user-defined pieces, and their byte lengths, longest first
    user_defined: HashMap<String, u32>,
    user_lengths: Vec<usize>,
    unknown: Option<u32>,
    /// the piece of each byte, when the vocabulary falls back to bytes
    bytes: Option<Vec<u32>>,
    /// control and unknown pieces, longest text first (parsing special tokens)
    specials: Vec<u32>,
    add_dummy_prefix: bool,
}

/// A pair of adjacent symbols whose concatenation is a piece.
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    /// The higher score first, then the leftmost (scores are never NaN; -0 equals 0, as
    /// SentencePiece's comparison has it).
    fn cmp(&self, other: &Self) -> Ordering {
        if self.score > other.score {
            Ordering::Greater
        } else if self.score < other.score {
            Ordering::Less
        } else {
            other.left.cmp(&self.left)
        }
    }
}

/// A symbol: `text[start..end]` (empty once merged into its left neighbour).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
    frozen: bool,
}

impl SentencePiece {
    /// The vocabulary as a GGUF file holds it. Every token type must be one of
    /// SentencePiece's (0-6), no piece empty or listed twice, no score NaN, at most one
    /// unknown piece, byte pieces `<0x00>`..`<0xFF>` all present or none, and an unknown
    /// piece or byte pieces to spell what no piece covers. The message of an error names
    /// the list and the index (`token_type[7]`).
    pub fn new(pieces: Vec<String>, types: &[i64], scores: &[f32], add_dummy_prefix: bool) -> Result<Self> {
        let n = pieces.len();
        if types.len() != n || scores.len() != n {
            return Err(Error::Input(format!("{} pieces, {} types and {} scores: one of each per piece", n, types.len(), scores.len())));
        }
        if n > u32::MAX as usize {
            return Err(Error::Input(format!("{n} pieces: more than ids can number")));
        }
        let mut kinds = Vec::with_capacity(n);
        let mut mergeable = HashMap::new();
        let mut reserved = HashMap::new();
        let mut user_defined = HashMap::new();
        let mut unknown = None;
        let mut byte_ids: Vec<Option<u32>> = vec![None; 256];
        let mut any_byte = false;
        for (i, piece) in pieces.iter().enumerate() {
            let id = i as u32;
            let kind = PieceKind::from_number(types[i])
                .ok_or_else(|| Error::Input(format!("token_type[{i}]: {} is not a SentencePiece piece type (0-6)", types[i])))?;
            if piece.is_empty() {
                return Err(Error::Input(format!("tokens[{i}]: a piece must not be empty")));
            }
            if scores[i].is_nan() {
                return Err(Error::Input(format!("scores[{i}]: NaN is not a score")));
            }
            let map = if kind.mergeable() { &mut mergeable } else { &mut reserved };
            if let Some(first) = map.insert(piece.clone(), id) {
                return Err(Error::Input(format!("tokens[{i}]: {piece:?} is already piece {first}")));
            }
            match kind {
                PieceKind::UserDefined => {
                    user_defined.insert(piece.clone(), id);
                }
                PieceKind::Unknown => {
                    if let Some(first) = unknown {
                        return Err(Error::Input(format!("token_type[{i}]: a second unknown piece (the first is {first})")));
                    }
                    unknown = Some(id);
                }
                PieceKind::Byte => {
                    let b = byte_of_piece(piece).ok_or_else(|| Error::Input(format!("tokens[{i}]: a byte piece must be written <0xAB>, got {piece:?}")))?;
                    byte_ids[b as usize] = Some(id);
                    any_byte = true;
                }
                _ => {}
            }
            kinds.push(kind);
        }
        let bytes = if any_byte {
            let missing = byte_ids.iter().position(Option::is_none);
            if let Some(b) = missing {
                return Err(Error::Input(format!("tokens: the byte piece <0x{b:02X}> is missing (byte pieces must cover all 256 bytes)")));
            }
            Some(byte_ids.into_iter().map(|b| b.unwrap_or(0)).collect())
        } else {
            None
        };
        if unknown.is_none() && bytes.is_none() {
            return Err(Error::Input("token_type: no unknown piece (type 2) and no byte pieces (type 6): text outside the pieces could not be encoded".into()));
        }
        let mut user_lengths: Vec<usize> = user_defined.keys().map(String::len).collect();
        user_lengths.sort_unstable_by(|a, b| b.cmp(a));
        user_lengths.dedup();
        let mut specials: Vec<u32> = (0..n as u32).filter(|&i| kinds[i as usize].special()).collect();
        specials.sort_by(|&a, &b| pieces[b as usize].len().cmp(&pieces[a as usize].len()).then(a.cmp(&b)));
        Ok(SentencePiece {
            pieces,
            kinds,
            scores: scores.to_vec(),
            mergeable,
            reserved,
            user_defined,
            user_lengths,
            unknown,
            bytes,
            specials,
            add_dummy_prefix,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// The id of a piece (reserved pieces first, as SentencePiece looks them up).
    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.reserved.get(piece).or_else(|| self.mergeable.get(piece)).copied()
    }

    /// The ids of `text`; with `parse_special`, control and unknown pieces written in it
    /// are their ids and the text between them is encoded piece by piece.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 2 + 2);
        if !parse_special {
            self.encode_text(text, &mut out);
            return out;
        }
        for part in self.split_specials(text) {
            match part {
                Part::Text(t) => self.encode_text(t, &mut out),
                Part::Special(id) => out.push(id),
            }
        }
        out
    }

    /// `text` cut at the special pieces written in it: each special piece, longest first,
    /// is taken out of every piece of text still left (llama.cpp's partition).
    fn split_specials<'t>(&self, text: &'t str) -> Vec<Part<'t>> {
        let mut parts = vec![Part::Text(text)];
        for &id in &self.specials {
            let piece = self.pieces[id as usize].as_str();
            if !text.contains(piece) {
                continue;
            }
            let mut next = Vec::with_capacity(parts.len() + 2);
            for part in parts {
                let Part::Text(mut rest) = part else {
                    next.push(part);
                    continue;
                };
                while let Some(at) = rest.find(piece) {
                    if at > 0 {
                        next.push(Part::Text(&rest[..at]));
                    }
                    next.push(Part::Special(id));
                    rest = &rest[at + piece.len()..];
                }
                if !rest.is_empty() {
                    next.push(Part::Text(rest));
                }
            }
            parts = next;
        }
        parts
    }

    /// The byte length of the longest user-defined piece `text` starts with.
    fn user_defined_prefix(&self, text: &str) -> Option<usize> {
        self.user_lengths
            .iter()
            .copied()
            .find(|&len| text.get(..len).is_some_and(|p| self.user_defined.contains_key(p)))
    }

    /// SentencePiece's encoding of one text (no special pieces parsed).
    fn encode_text(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        // normalization: the dummy prefix, ' ' as "▁"; user-defined pieces kept as written
        let mut norm = String::with_capacity(text.len() + 8);
        if self.add_dummy_prefix {
            norm.push(SPACE);
        }
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            let len = match self.user_defined_prefix(rest) {
                Some(len) => {
                    norm.push_str(&rest[..len]);
                    len
                }
                None => {
                    norm.push(if c == ' ' { SPACE } else { c });
                    c.len_utf8()
                }
            };
            rest = &rest[len..];
        }

        // symbols: characters, and user-defined pieces whole (frozen)
        let mut symbols: Vec<Symbol> = Vec::with_capacity(norm.len());
        let mut at = 0;
        while at < norm.len() {
            let (len, frozen) = match self.user_defined_prefix(&norm[at..]) {
                Some(len) => (len, true),
                None => (norm[at..].chars().next().map_or(1, char::len_utf8), false),
            };
            let i = symbols.len();
            symbols.push(Symbol { start: at, end: at + len, prev: i.checked_sub(1), next: None, frozen });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
            at += len;
        }

        let mut agenda = BinaryHeap::new();
        // the parts an unused piece was merged from, to split it back
        let mut unmerge: HashMap<&str, (&str, &str)> = HashMap::new();
        let norm = norm.as_str();
        let mut consider = |symbols: &[Symbol], agenda: &mut BinaryHeap<Pair>, left: Option<usize>, right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else { return };
            let (a, b) = (symbols[l], symbols[r]);
            if a.frozen || b.frozen {
                return;
            }
            let merged = &norm[a.start..b.end];
            let Some(&id) = self.mergeable.get(merged) else { return };
            agenda.push(Pair { score: self.scores[id as usize], left: l, right: r, len: merged.len() });
            if self.kinds[id as usize] == PieceKind::Unused {
                unmerge.insert(merged, (&norm[a.start..a.end], &norm[b.start..b.end]));
            }
        };
        for i in 1..symbols.len() {
            consider(&symbols, &mut agenda, Some(i - 1), Some(i));
        }
        while let Some(top) = agenda.pop() {
            let (l, r) = (symbols[top.left], symbols[top.right]);
            // stale: one side has changed since the pair was found
            if l.start == l.end || r.start == r.end || (l.end - l.start) + (r.end - r.start) != top.len {
                continue;
            }
            symbols[top.left].end = r.end;
            symbols[top.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(top.left);
            }
            symbols[top.right].end = symbols[top.right].start;
            consider(&symbols, &mut agenda, symbols[top.left].prev, Some(top.left));
            consider(&symbols, &mut agenda, Some(top.left), symbols[top.left].next);
        }

        // each final symbol: its piece, unused pieces split back, unknowns as bytes
        let mut previous_unknown = false;
        let mut stack: Vec<&str> = Vec::new();
        let mut next = (!symbols.is_empty()).then_some(0);
        while let Some(i) = next {
            next = symbols[i].next;
            stack.push(&norm[symbols[i].start..symbols[i].end]);
            while let Some(piece) = stack.pop() {
                let id = self.piece_to_id(piece);
                if let Some(id) = id {
                    if self.kinds[id as usize] == PieceKind::Unused {
                        if let Some(&(a, b)) = unmerge.get(piece) {
                            stack.push(b);
                            stack.push(a);
                            continue;
                        }
                    }
                }
                let unknown = id.is_none_or(|id| self.kinds[id as usize] == PieceKind::Unknown);
                match (&self.bytes, unknown) {
                    (Some(bytes), true) => out.extend(piece.bytes().map(|b| bytes[b as usize])),
                    (None, true) if previous_unknown => {} // fused with the unknown before it
                    _ => out.extend(id.or(self.unknown)),
                }
                previous_unknown = unknown;
            }
        }
    }

    /// The text of `ids` (see the module's documentation). `continuation`: the ids
    /// continue a text, so their first piece keeps its leading space.
    pub fn decode(&self, ids: &[u32], skip_special: bool, continuation: bool) -> Result<String> {
        let mut text = String::new();
        let mut pending: Vec<u8> = Vec::new();
        // where the text after the last special token begins
        let mut segment = 0;
        let mut at_start = !continuation;
        let mut stripped = false;
        for (index, &id) in ids.iter().enumerate() {
            let Some(kind) = self.kinds.get(id as usize).copied() else {
                return Err(Error::TokenId { id: id.to_string(), index, vocab: self.pieces.len() });
            };
            let piece = self.pieces[id as usize].as_str();
            if kind == PieceKind::Byte {
                pending.push(byte_of_piece(piece).unwrap_or(0));
                continue;
            }
            push_bytes(&mut text, &mut pending);
            if stripped || text.len() > segment {
                at_start = false;
            }
            stripped = false;
            match kind {
                _ if kind.special() && !skip_special => {
                    text.push_str(piece);
                    segment = text.len();
                    at_start = true;
                }
                PieceKind::Control => {}
                PieceKind::Unknown => text.push_str(UNKNOWN_SURFACE),
                _ => {
                    let mut piece = piece;
                    if at_start && self.add_dummy_prefix {
                        if let Some(rest) = piece.strip_prefix(SPACE) {
                            piece = rest;
                            stripped = true;
                        }
                    }
                    text.extend(piece.chars().map(|c| if c == SPACE { ' ' } else { c }));
                }
            }
        }
        push_bytes(&mut text, &mut pending);
        Ok(text)
    }
}

enum Part<'t> {
    Text(&'t str),
    Special(u32),
}

/// Appends `bytes` read as UTF-8, each byte that does not begin a valid character as
/// U+FFFD (SentencePiece's reading of byte pieces), and empties it.
fn push_bytes(text: &mut String, bytes: &mut Vec<u8>) {
    let mut rest = bytes.as_slice();
    while let Some(&lead) = rest.first() {
        let len = match lead {
            0x00..=0x7F => 1,
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 0,
        };
        match rest.get(..len).filter(|_| len > 0).map(std::str::from_utf8) {
            Some(Ok(c)) => {
                text.push_str(c);
                rest = &rest[len..];
            }
            _ => {
                text.push('\u{FFFD}');
                rest = &rest[1..];
            }
        }
    }
    bytes.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary: <unk>, <s>, </s>, the 256 bytes, then `normal` (score -index).
    fn vocab(normal: &[&str], prefix: bool) -> SentencePiece {
        let mut pieces: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        for b in 0..=255u8 {
            pieces.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        for p in normal {
            pieces.push((*p).into());
            types.push(1);
        }
        let scores: Vec<f32> = (0..pieces.len()).map(|i| if i < 259 { 0.0 } else { -((i - 259) as f32) }).collect();
        SentencePiece::new(pieces, &types, &scores, prefix).unwrap()
    }

    fn spell(sp: &SentencePiece, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| sp.id_to_piece(i).unwrap().to_string()).collect()
    }

    #[test]
    fn the_dummy_prefix_comes_before_leading_spaces() {
        let sp = vocab(&["▁", "H", "i", "Hi", "▁Hi", "▁▁"], true);
        assert_eq!(spell(&sp, &sp.encode("Hi", false)), ["▁Hi"]);
        // "▁Hi" scores higher than "▁▁", so " Hi" is ▁ ▁Hi
        assert_eq!(spell(&sp, &sp.encode(" Hi", false)), ["▁", "▁Hi"]);
        assert_eq!(spell(&sp, &sp.encode(" ", false)), ["▁▁"]);
        assert!(sp.encode("", false).is_empty());
        for text in ["Hi", " Hi", "  Hi ", " "] {
            assert_eq!(sp.decode(&sp.encode(text, false), true, false).unwrap(), text);
        }
    }

    #[test]
    fn bytes_spell_what_no_piece_covers_and_decode_back() {
        let sp = vocab(&["▁", "a"], true);
        let ids = sp.encode("a\u{4e16}", false);
        assert_eq!(spell(&sp, &ids), ["▁", "a", "<0xE4>", "<0xB8>", "<0x96>"]);
        assert_eq!(sp.decode(&ids, true, false).unwrap(), "a\u{4e16}");
        // a lone continuation byte and a truncated character are U+FFFD each byte
        let bad = [sp.piece_to_id("<0xB8>").unwrap(), sp.piece_to_id("<0xE4>").unwrap(), sp.piece_to_id("a").unwrap()];
        assert_eq!(sp.decode(&bad, true, false).unwrap(), "\u{FFFD}\u{FFFD}a");
    }

    #[test]
    fn special_pieces_are_text_unless_parsed() {
        let sp = vocab(&["▁", "<", "s", ">", "x"], true);
        assert_eq!(spell(&sp, &sp.encode("<s>x", false)), ["▁", "<", "s", ">", "x"]);
        let parsed = sp.encode("<s>x", true);
        assert_eq!(spell(&sp, &parsed), ["<s>", "▁", "x"]);
        assert_eq!(sp.decode(&parsed, false, false).unwrap(), "<s>x");
        assert_eq!(sp.decode(&parsed, true, false).unwrap(), "x");
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        // "ab" and "bc" would both be wanted in "abc": with equal scores the left one wins
        let mut pieces: Vec<String> = vec!["<unk>".into(), "a".into(), "b".into(), "c".into(), "ab".into(), "bc".into()];
        let types = [2, 1, 1, 1, 1, 1];
        let sp = SentencePiece::new(std::mem::take(&mut pieces), &types, &[0.0, -1.0, -1.0, -1.0, -5.0, -5.0], false).unwrap();
        assert_eq!(spell(&sp, &sp.encode("abc", false)), ["ab", "c"]);
    }

    #[test]
    fn unknown_runs_fuse_without_byte_pieces() {
        let pieces: Vec<String> = ["<unk>", "a"].map(String::from).to_vec();
        let sp = SentencePiece::new(pieces, &[2, 1], &[0.0, -1.0], false).unwrap();
        assert_eq!(sp.encode("a\u{4e16}\u{754c}a", false), [1, 0, 1]);
        assert_eq!(sp.decode(&[1, 0, 1], true, false).unwrap(), "a \u{2047} a");
    }

    #[test]
    fn bad_vocabularies_are_refused_by_index() {
        let err = |pieces: &[&str], types: &[i64], scores: &[f32]| {
            let p: Vec<String> = pieces.iter().map(|s| s.to_string()).collect();
            SentencePiece::new(p, types, scores, true).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(err(&["<unk>", "a"], &[2, 9], &[0.0, 0.0]).contains("token_type[1]"));
        assert!(err(&["<unk>", "a"], &[2, 1], &[0.0, f32::NAN]).contains("scores[1]"));
        assert!(err(&["<unk>", ""], &[2, 1], &[0.0, 0.0]).contains("tokens[1]"));
        assert!(err(&["a"], &[1], &[0.0]).contains("no unknown piece"));
        assert!(err(&["<unk>", "<0x00>"], &[2, 6], &[0.0, 0.0]).contains("<0x01> is missing"));
    }
}
