//! `overrides_file`: a YAML map `KEY: PLAN` / `KEY: exempt` for many consumers at once.
//!
//! Built for a million entries and more (a customer table exported nightly), so it is neither a
//! `HashMap<String, String>` nor parsed into one first: the keys go into one byte arena as they
//! are read, indexed by a SwissTable (`hashbrown::HashTable`) of 8-byte slots, and each value is
//! a 16-bit code (exempt, or a plan). A lookup on the request path hashes the key once and
//! compares bytes in the arena: no allocation, no pointer per entry. Keys are stored as the
//! gateway writes keys ([`crate::keytext::from_admin`], as `/admin/limits` takes them), so the
//! file names a consumer the way the admin API and `when.key` do.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::path::Path;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_saphyr::Spanned;

use super::types::Plan;
use super::{Invalid, Pos};

/// More entries than this are refused: the table's slots address the arena with 32 bits, and
/// an operator with more consumers than this wants a store, not a file.
pub(super) const MAX_ENTRIES: usize = 50_000_000;

/// The word that exempts a key instead of naming a plan.
const EXEMPT: &str = "exempt";

/// What the file gives one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableEntry {
    /// The limit does not count this key's requests.
    Exempt,
    /// This plan's rate (an index into the config's `plans`).
    Plan(usize),
}

/// Where a key sits in the arena and what it gets: 8 bytes a slot.
#[derive(Clone, Copy)]
struct Slot {
    start: u32,
    len: u16,
    /// 0: exempt; `n`: plan `n - 1`.
    code: u16,
}

/// The entries of one overrides file (see the module).
pub struct OverridesTable {
    arena: Vec<u8>,
    index: hashbrown::HashTable<Slot>,
    hasher: foldhash::fast::RandomState,
    /// A hash of the file's bytes: two loads of the same file compare equal without comparing
    /// a million entries.
    fingerprint: u64,
}

impl fmt::Debug for OverridesTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverridesTable")
            .field("entries", &self.len())
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

impl OverridesTable {
    /// What the file gives `key` (in stored form), if it names it.
    #[inline]
    pub fn get(&self, key: &[u8]) -> Option<TableEntry> {
        let hash = self.hasher.hash_one(key);
        let slot = self.index.find(hash, |s| self.key_of(*s) == key)?;
        Some(match slot.code {
            0 => TableEntry::Exempt,
            n => TableEntry::Plan(usize::from(n) - 1),
        })
    }

    /// Entries in the file.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the file has no entry.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// A hash of the bytes the table was read from.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Bytes the table holds on the heap (arena and index), for sizing and the docs' figures.
    pub fn heap_bytes(&self) -> usize {
        // A SwissTable holds one control byte beside each slot (and a group's worth more).
        self.arena.capacity() + self.index.capacity() * (std::mem::size_of::<Slot>() + 1)
    }

    /// How many entries' keys have a number of `|`-separated parts other than `parts`: they can
    /// never match a key of that many parts.
    pub fn misshapen(&self, parts: usize) -> usize {
        self.index
            .iter()
            .filter(|s| self.key_of(**s).iter().filter(|&&b| b == b'|').count() + 1 != parts)
            .count()
    }

    /// How many entries give each plan (indexed like the config's `plans`), and how many exempt.
    pub fn counts(&self, plans: usize) -> (Vec<usize>, usize) {
        let mut per_plan = vec![0; plans];
        let mut exempt = 0;
        for s in &self.index {
            match s.code {
                0 => exempt += 1,
                n => {
                    if let Some(c) = per_plan.get_mut(usize::from(n) - 1) {
                        *c += 1;
                    }
                }
            }
        }
        (per_plan, exempt)
    }

    fn key_of(&self, s: Slot) -> &[u8] {
        let start = s.start as usize;
        &self.arena[start..start + usize::from(s.len)]
    }
}

/// Reads the overrides file at `path`; its plans are looked up in `plans`. A refusal carries
/// the file's own path, line and column.
/// `Ok(Err(_))`: the file could not be read at all (no line of it to point at: the caller
/// points at the config's `overrides_file:`).
pub(super) fn load(
    path: &Path,
    plans: &[Plan],
) -> Result<Result<OverridesTable, Invalid>, std::io::Error> {
    let bytes = std::fs::read(path)?;
    Ok(read(path, bytes, plans))
}

fn read(path: &Path, bytes: Vec<u8>, plans: &[Plan]) -> Result<OverridesTable, Invalid> {
    let fingerprint = foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).hash_one(&bytes);
    let text = super::utf8(bytes).map_err(|e| e.in_other_file(path))?;
    parse(&text, plans, fingerprint).map_err(|e| e.in_other_file(path))
}

/// [`load`] on text already read.
fn parse(text: &str, plans: &[Plan], fingerprint: u64) -> Result<OverridesTable, Invalid> {
    if super::is_empty(text) {
        // An empty file is an empty table (every consumer back on the limit's rate), which an
        // operator may well mean; `{}` says so without doubt, but both load.
        return Ok(empty(fingerprint));
    }
    match plain_lines(text) {
        Some(raw) => table(raw, plans, fingerprint),
        None => parse_yaml(text, plans, fingerprint),
    }
}

/// [`parse`] by the YAML parser, whatever the file's form.
fn parse_yaml(text: &str, plans: &[Plan], fingerprint: u64) -> Result<OverridesTable, Invalid> {
    // The parser's default budget is sized for a config (a million events); a table of
    // MAX_ENTRIES takes two scalars an entry.
    let mut budget = serde_saphyr::Budget::default();
    budget.max_events = 4 * MAX_ENTRIES + 16;
    budget.max_nodes = 2 * MAX_ENTRIES + 16;
    budget.max_total_scalar_bytes = usize::MAX;
    budget.max_reader_input_bytes = None;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    let raw: Option<RawTable> =
        serde_saphyr::from_str_with_options(text, options).map_err(|e| {
            let at = e.location().map_or(Pos { line: 1, column: 1 }, Pos::of);
            Invalid::new(at, super::raw::plain_message(&e))
        })?;
    let Some(raw) = raw else {
        return Ok(empty(fingerprint));
    };
    table(raw, plans, fingerprint)
}

/// The table from what was read: the names checked against `plans`, then coded.
fn table(raw: RawTable, plans: &[Plan], fingerprint: u64) -> Result<OverridesTable, Invalid> {
    if let Some((at, message)) = raw.problem {
        return Err(Invalid::new(at, message));
    }
    // Each name the file used, to its code: 0 for `exempt`, a plan's index + 1.
    let mut codes = Vec::with_capacity(raw.names.len());
    for (name, at) in &raw.names {
        if name == EXEMPT {
            codes.push(0);
            continue;
        }
        match plans.iter().position(|p| &p.name == name) {
            // `plans` is a YAML map, far below 2^16 names in any file that loads.
            Some(i) => codes.push(u16::try_from(i + 1).unwrap_or(u16::MAX)),
            None => {
                let known = known_plans(plans);
                return Err(Invalid::new(
                    *at,
                    format!(
                        "`{name}` is not a plan ({known}); a value is a plan's name or `exempt`"
                    ),
                ));
            }
        }
    }
    let mut index = raw.index;
    for slot in index.iter_mut() {
        slot.code = codes[usize::from(slot.code)];
    }
    Ok(OverridesTable {
        arena: raw.arena,
        index,
        hasher: raw.hasher,
        fingerprint,
    })
}

/// The file read line by line, when every line is in the plain form an export writes:
/// `KEY: PLAN` with a key of letters, digits and `_ . / + = -` (starting with a letter, a digit
/// or `_`; not one YAML reads as a number in another spelling, such as `0x1F`), a plan's name, an optional ` # comment`; blank and comment lines. YAML reads such
/// a line as that string key and that string value, so this gives the table the YAML parser
/// would (a unit test holds the two to it), about ten times faster and without its memory for
/// a million entries. Any other line (quotes, flow style, anchors, a key YAML reads as null):
/// `None`, and the whole file goes to the YAML parser.
fn plain_lines(text: &str) -> Option<RawTable> {
    let key_char =
        |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'+' | b'=' | b'-');
    let name_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-');
    let mut t = RawTable::new(text.len() / 24, text.len());
    let mut name_codes: HashMap<String, u16> = HashMap::new();
    for (n, line) in text.trim_start_matches('\u{feff}').split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim_start().is_empty() || line.starts_with('#') {
            continue;
        }
        let b = line.as_bytes();
        let key_len = b.iter().position(|&c| !key_char(c)).unwrap_or(b.len());
        let key = &line[..key_len];
        let first_ok = b
            .first()
            .is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_');
        // YAML reads `0x1F`, `0o17`, `0b1` and `1_000` as integers and holds two spellings of
        // one number to be one key: such keys (and null) are left to the YAML parser.
        let kb = key.as_bytes();
        let integer_like = kb.first().is_some_and(u8::is_ascii_digit)
            && (kb.contains(&b'_')
                || (kb.len() > 1
                    && kb[0] == b'0'
                    && matches!(kb[1], b'x' | b'X' | b'o' | b'O' | b'b' | b'B')));
        if !first_ok || integer_like || matches!(key, "null" | "Null" | "NULL") {
            return None;
        }
        let rest = line[key_len..].strip_prefix(':')?;
        let value_start = rest.len() - rest.trim_start_matches(' ').len();
        if value_start == 0 {
            return None;
        }
        let value_and_tail = &rest[value_start..];
        let value_len = value_and_tail
            .bytes()
            .position(|c| !name_char(c))
            .unwrap_or(value_and_tail.len());
        let (value, tail) = value_and_tail.split_at(value_len);
        let tail = tail.trim_start_matches(' ');
        // A comment needs a space before its `#`.
        let spaced = tail.len() < value_and_tail.len() - value_len;
        let plain_end = tail.is_empty() || (tail.starts_with('#') && spaced);
        if value.is_empty() || !plain_end || matches!(value, "null" | "Null" | "NULL") {
            return None;
        }
        let line_no = n as u64 + 1;
        let value_col = (key_len + 1 + value_start) as u64 + 1;
        t.add(
            (
                key,
                Pos {
                    line: line_no,
                    column: 1,
                },
            ),
            (
                value,
                Pos {
                    line: line_no,
                    column: value_col,
                },
            ),
            &mut name_codes,
        );
    }
    t.arena.shrink_to_fit();
    Some(t)
}

fn empty(fingerprint: u64) -> OverridesTable {
    OverridesTable {
        arena: Vec::new(),
        index: hashbrown::HashTable::new(),
        hasher: foldhash::fast::RandomState::default(),
        fingerprint,
    }
}

/// The table as read, values still as the file's names (`code` indexes `names`).
struct RawTable {
    arena: Vec<u8>,
    index: hashbrown::HashTable<Slot>,
    hasher: foldhash::fast::RandomState,
    /// The key being added, in stored form (reused: no allocation per entry).
    stored: crate::keytext::KeyBuf,
    /// Each distinct value, where it was first used.
    names: Vec<(String, Pos)>,
    /// The first entry refused, where and why. Kept rather than returned as a serde error, which
    /// the parser would place at the start of the map instead of at the entry.
    problem: Option<(Pos, String)>,
}

impl RawTable {
    /// Adds one entry; `Err` says why it cannot be.
    /// Room for about `capacity` entries of `bytes` key bytes in all.
    fn new(capacity: usize, bytes: usize) -> Self {
        Self {
            arena: Vec::with_capacity(bytes),
            stored: crate::keytext::KeyBuf::new(),
            index: hashbrown::HashTable::with_capacity(capacity),
            hasher: foldhash::fast::RandomState::default(),
            names: Vec::new(),
            problem: None,
        }
    }

    /// Adds `key: value` unless an entry was refused before; the first refusal is kept with
    /// the key's position.
    fn add(
        &mut self,
        (key, key_at): (&str, Pos),
        (value, value_at): (&str, Pos),
        name_codes: &mut HashMap<String, u16>,
    ) {
        if self.problem.is_none()
            && let Err(why) = self.insert(key, (value, value_at), name_codes)
        {
            self.problem = Some((key_at, why));
        }
    }

    fn insert(
        &mut self,
        key: &str,
        (value, value_at): (&str, Pos),
        name_codes: &mut HashMap<String, u16>,
    ) -> Result<(), String> {
        if self.index.len() >= MAX_ENTRIES {
            return Err(format!(
                "more than {MAX_ENTRIES} entries: keep a file under that"
            ));
        }
        let mut stored = std::mem::take(&mut self.stored);
        crate::keytext::from_admin_into(key, &mut stored);
        let added = self.insert_stored(key, &stored, (value, value_at), name_codes);
        self.stored = stored;
        added
    }

    fn insert_stored(
        &mut self,
        key: &str,
        stored: &[u8],
        (value, value_at): (&str, Pos),
        name_codes: &mut HashMap<String, u16>,
    ) -> Result<(), String> {
        let (Ok(len), Ok(start)) = (u16::try_from(stored.len()), u32::try_from(self.arena.len()))
        else {
            return Err(
                "the file is too large: keys must stay under 64 KiB each and 4 GiB in all".into(),
            );
        };
        if stored.is_empty() {
            return Err("an empty key names no consumer".into());
        }
        let code = match name_codes.get(value) {
            Some(c) => *c,
            None => {
                let c = u16::try_from(self.names.len())
                    .map_err(|_| "more than 65535 different plan names".to_owned())?;
                name_codes.insert(value.to_owned(), c);
                self.names.push((value.to_owned(), value_at));
                c
            }
        };
        let hash = self.hasher.hash_one(stored);
        let arena = &self.arena;
        let key_of = |s: &Slot| {
            let b = s.start as usize;
            &arena[b..b + usize::from(s.len)]
        };
        if self.index.find(hash, |s| key_of(s) == stored).is_some() {
            return Err(format!(
                "`{key}` is listed twice (as the gateway stores keys, `{}`): keep one entry",
                String::from_utf8_lossy(stored)
            ));
        }
        self.arena.extend_from_slice(stored);
        let (hasher, arena) = (&self.hasher, &self.arena);
        self.index
            .insert_unique(hash, Slot { start, len, code }, |s| {
                let b = s.start as usize;
                hasher.hash_one(&arena[b..b + usize::from(s.len)])
            });
        Ok(())
    }
}

impl<'de> de::Deserialize<'de> for RawTable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TableVisitor)
    }
}

struct TableVisitor;

impl<'de> Visitor<'de> for TableVisitor {
    type Value = RawTable;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a mapping of keys to a plan's name or `exempt` (`KEY: PLAN` lines)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawTable, A::Error> {
        let mut t = RawTable::new(map.size_hint().unwrap_or(0), 0);
        let mut name_codes: HashMap<String, u16> = HashMap::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            let value: Spanned<String> = map.next_value()?;
            t.add(
                (&key.value, Pos::of(key.referenced)),
                (&value.value, Pos::of(value.referenced)),
                &mut name_codes,
            );
        }
        t.arena.shrink_to_fit();
        Ok(t)
    }
}

/// The plans a name could have been, for a refusal: `plans: free, pro`.
pub(super) fn known_plans(plans: &[Plan]) -> String {
    if plans.is_empty() {
        return "the config has no top-level `plans:`".to_owned();
    }
    let names: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
    format!("plans: {}", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;
    use std::time::Duration;

    fn plans() -> Vec<Plan> {
        ["free", "pro"]
            .iter()
            .enumerate()
            .map(|(i, n)| Plan {
                name: (*n).to_owned(),
                rate: Rate {
                    count: 10 * (i as u64 + 1),
                    period: Duration::from_secs(60),
                },
                burst: None,
            })
            .collect()
    }

    fn table(text: &str) -> Result<OverridesTable, Invalid> {
        parse(text, &plans(), 0)
    }

    #[test]
    fn entries_give_their_plan_or_exempt() {
        let t = table("acme: pro\nbeta: free\n\"partner key\": exempt\n'12345': pro\n").unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t.get(b"acme"), Some(TableEntry::Plan(1)));
        assert_eq!(t.get(b"beta"), Some(TableEntry::Plan(0)));
        // Stored as the gateway writes keys: the space escaped.
        assert_eq!(t.get(b"partner%20key"), Some(TableEntry::Exempt));
        assert_eq!(t.get(b"12345"), Some(TableEntry::Plan(1)));
        assert_eq!(t.get(b"nobody"), None);
        assert_eq!(t.counts(2), (vec![1, 2], 1));
    }

    #[test]
    fn an_empty_file_or_map_is_an_empty_table() {
        for text in ["", "# nobody yet\n", "{}\n"] {
            assert!(table(text).unwrap().is_empty(), "{text:?}");
        }
    }

    #[test]
    fn refusals_point_at_the_line() {
        let e = table("acme: pro\nbeta: gold\n").unwrap_err();
        assert_eq!((e.at.line, e.at.column), (2, 7), "{}", e.message);
        assert!(e.message.contains("`gold` is not a plan"), "{}", e.message);
        let e = table("acme: pro\nacme: free\n").unwrap_err();
        assert_eq!(e.at.line, 2, "{}", e.message);
        let e = table("- acme\n").unwrap_err();
        assert_eq!(e.at.line, 1, "{}", e.message);
        let e = table("acme: [pro]\n").unwrap_err();
        assert_eq!(e.at.line, 1, "{}", e.message);
    }

    #[test]
    fn two_spellings_of_one_stored_key_are_a_duplicate() {
        let e = table("\"a b\": pro\n\"a%20b\": free\n").unwrap_err();
        assert!(e.message.contains("listed twice"), "{}", e.message);
        assert_eq!(e.at.line, 2);
    }

    #[test]
    fn a_long_key_is_stored_hashed_as_a_request_would_be() {
        let long = "k".repeat(100);
        let t = table(&format!("{long}: pro\n")).unwrap();
        assert_eq!(
            t.get(&crate::keytext::from_admin(&long)),
            Some(TableEntry::Plan(1))
        );
    }

    /// Every entry as `(stored key, entry)`, sorted: two tables compared by content.
    fn entries(t: &OverridesTable) -> Vec<(Vec<u8>, Option<TableEntry>)> {
        let mut all: Vec<_> = t
            .index
            .iter()
            .map(|s| (t.key_of(*s).to_vec(), t.get(t.key_of(*s))))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    proptest::proptest! {
        /// The line reader gives what the YAML parser gives, whenever it takes a file: the
        /// same entries, or the same refusal at the same place.
        #[test]
        fn plain_lines_read_as_yaml_does(
            lines in proptest::collection::vec(
                (
                    "[a-c0-2_][a-c0-2_.=+/-]{0,3}|[0-2][xobXOB_0-2]{0,3}|[a-z0-9_.=+/#:~ -]{0,6}|null|~",
                    "(pro|free|exempt|gold|null|[a-z#]{1,3})",
                    "( ?# ?[a-z]{0,3}| {0,2})",
                    proptest::bool::ANY,
                ),
                0..12,
            )
        ) {
            let mut text = String::new();
            for (key, value, tail, blank) in &lines {
                if *blank {
                    text.push_str("# note\n\n");
                }
                text.push_str(&format!("{key}: {value}{tail}\n"));
            }
            if super::super::is_empty(&text) {
                return Ok(());
            }
            if plain_lines(&text).is_some() {
                let fast = parse(&text, &plans(), 0);
                let yaml = parse_yaml(&text, &plans(), 0);
                match (fast, yaml) {
                    (Ok(a), Ok(b)) => proptest::prop_assert_eq!(entries(&a), entries(&b), "{}", text),
                    (Err(a), Err(b)) => {
                        // A duplicate is worded by each reader in its own way, at the same key.
                        let duplicate = |m: &str| m.contains("twice") || m.contains("duplicate");
                        proptest::prop_assert!(
                            a.message == b.message || (duplicate(&a.message) && duplicate(&b.message)),
                            "{}: {} / {}", text, a.message, b.message
                        );
                        proptest::prop_assert_eq!(a.at, b.at, "{}", text);
                    }
                    (a, b) => proptest::prop_assert!(false, "{text}: line reader {a:?}, YAML {b:?}"),
                }
            }
        }
    }

    #[test]
    fn a_file_outside_the_plain_form_goes_to_the_yaml_parser() {
        for text in [
            "\"a b\": pro\n",
            "{a: pro}\n",
            "  a: pro\n",
            "a:\tpro\n",
            "---\na: pro\n",
        ] {
            assert!(plain_lines(text).is_none(), "{text:?}");
            assert!(table(text).is_ok(), "{text:?}");
        }
        assert!(plain_lines("a: pro\nb.c/d=e-f+g: exempt # note\n").is_some());
    }

    #[test]
    fn many_entries_load_and_are_all_found() {
        let mut text = String::new();
        for i in 0..20_000 {
            text.push_str(&format!(
                "key-{i}: {}\n",
                if i % 2 == 0 { "pro" } else { "exempt" }
            ));
        }
        let t = table(&text).unwrap();
        assert_eq!(t.len(), 20_000);
        for i in (0..20_000).step_by(997) {
            let want = if i % 2 == 0 {
                TableEntry::Plan(1)
            } else {
                TableEntry::Exempt
            };
            assert_eq!(t.get(format!("key-{i}").as_bytes()), Some(want));
        }
    }
}
