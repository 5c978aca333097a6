//! Training data: the byte tokenizer, the built-in synthetic corpus, text files, and
//! deterministic sharding of samples between data-driving peers.
//!
//! A sample is `seq + 1` consecutive tokens: the model reads the first `seq` and is scored on
//! predicting the last `seq`. Sample `i` is a pure function of (corpus, seed, i), and shard `k`
//! of `n` reads the samples `i ≡ k (mod n)`, so peers that drive data never read the same
//! sample and any peer can recompute what another read.

use crate::rng::{Rng, derive_seed};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Token ids of the byte-level tokenizer: one token per byte.
pub const BYTE_VOCAB: usize = 256;
/// Token ids of GPT-2's BPE (r50k_base), the end-of-text token the last.
pub const GPT2_VOCAB: usize = 50257;

/// llm.c's token shard: a header of 256 little-endian i32 (magic, version, token count, ...)
/// then the tokens as little-endian u16. shoal also writes the vocabulary's size in the
/// fourth field (0, as llm.c leaves it, means GPT-2's), so byte shards say they are.
pub const SHARD_MAGIC: i32 = 20240520;
const SHARD_HEADER: usize = 256 * 4;

/// Writes `tokens` (ids below `vocab` <= 65536) as an llm.c token shard.
pub fn write_shard(path: &Path, tokens: &[u32], vocab: usize) -> std::io::Result<()> {
    let mut header = [0i32; 256];
    header[0] = SHARD_MAGIC;
    header[1] = 1;
    header[2] = i32::try_from(tokens.len()).map_err(std::io::Error::other)?;
    header[3] = if vocab == GPT2_VOCAB { 0 } else { vocab as i32 };
    let mut bytes = Vec::with_capacity(SHARD_HEADER + 2 * tokens.len());
    bytes.extend(header.iter().flat_map(|h| h.to_le_bytes()));
    for &t in tokens {
        let t = u16::try_from(t).map_err(std::io::Error::other)?;
        bytes.extend(t.to_le_bytes());
    }
    crate::write_atomic(path, &bytes)
}

/// The tokens and vocabulary of an llm.c shard, if `bytes` is one.
fn read_shard(path: &Path, bytes: &[u8]) -> Option<Result<(Vec<u32>, usize), DataError>> {
    let field = |i: usize| {
        i32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    if bytes.len() < SHARD_HEADER || field(0) != SHARD_MAGIC {
        return None;
    }
    let bad = |why: String| {
        Some(Err(DataError::BadShard {
            path: path.to_owned(),
            why,
        }))
    };
    if field(1) != 1 {
        return bad(format!("version {} (1 is read)", field(1)));
    }
    let count = field(2);
    let body = &bytes[SHARD_HEADER..];
    if count < 0 || body.len() != 2 * count as usize {
        return bad(format!(
            "the header says {count} tokens, the file holds {} bytes of them",
            body.len()
        ));
    }
    let vocab = match field(3) {
        0 => GPT2_VOCAB,
        v if (1..=65536).contains(&v) => v as usize,
        v => return bad(format!("a vocabulary of {v}")),
    };
    let tokens: Vec<u32> = body
        .chunks_exact(2)
        .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    if let Some(t) = tokens.iter().find(|t| **t as usize >= vocab) {
        return bad(format!("token {t} outside its vocabulary of {vocab}"));
    }
    Some(Ok((tokens, vocab)))
}

/// Encodes text as byte tokens.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Decodes byte tokens into text (invalid UTF-8 is replaced, ids above 255 become `?`).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .map(|&t| u8::try_from(t).unwrap_or(b'?'))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Problems with training data.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file could not be read.
    #[error("cannot read data file {path}: {source}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("data file {path} is not UTF-8 text (invalid byte at offset {offset})")]
    NotText {
        /// The file.
        path: PathBuf,
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The file has fewer tokens than one sample needs.
    #[error("data file {path} has {bytes} bytes; at least {needed} are needed for one sample")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Bytes in the file.
        bytes: usize,
        /// Bytes one sample needs.
        needed: usize,
    },
    /// A token shard that cannot be read.
    #[error("token shard {path}: {why}")]
    BadShard {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// An impossible shard.
    #[error("shard {index} of {count} does not exist")]
    NoSuchShard {
        /// Requested shard index.
        index: u64,
        /// Requested shard count.
        count: u64,
    },
}

/// The alphabet the synthetic source writes in (32 symbols, so samples are readable).
const SYNTHETIC_ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz .,;'\n";
/// Likely followers of each symbol.
const SYNTHETIC_FOLLOWERS: usize = 8;
/// Draws from those followers that make up each two-symbol context's distribution; the rest
/// of the alphabet shares `SYNTHETIC_SMOOTHING`.
const SYNTHETIC_BRANCHING: usize = 3;
/// Probability mass spread uniformly over all symbols in every context: it makes the chain
/// irreducible and aperiodic, so the stationary distribution is unique.
const SYNTHETIC_SMOOTHING: f64 = 0.02;

/// A second-order Markov source over a 32-symbol alphabet, generated from a seed.
///
/// Its entropy rate `H(X_t | X_{t-1}, X_{t-2})` is computed exactly from the transition table
/// and its stationary distribution, so the best loss any model can reach is known: a model that
/// sees the whole context can do no better than the true conditional distribution.
#[derive(Clone, Debug)]
pub struct MarkovSource {
    /// `next[(a * 32 + b) * 32 + c] = P(c | a, b)`.
    next: Vec<f64>,
    /// Stationary distribution of pairs `(a, b)`.
    stationary: Vec<f64>,
    /// Entropy rate in nats per token.
    entropy_rate: f64,
    /// `H(X_1 | X_0)` under the stationary distribution, in nats.
    first_order_entropy: f64,
    /// `H(X)` of the stationary single-symbol distribution, in nats.
    unigram_entropy: f64,
}

fn entropy(p: &[f64]) -> f64 {
    p.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum()
}

impl MarkovSource {
    /// The source generated from `seed`.
    pub fn new(seed: u64) -> Self {
        const A: usize = SYNTHETIC_ALPHABET.len();
        let mut rng = Rng::new(derive_seed(seed, &[0x5e_ed_da_7a]));
        let mut next = vec![SYNTHETIC_SMOOTHING / A as f64; A * A * A];
        // Each symbol b has a small set of likely followers; the symbol before it, a, picks a
        // few of them with its own weights. So one token of context already says much (easy
        // to learn) and the second says more (needs attention to the previous position).
        let followers: Vec<[usize; SYNTHETIC_FOLLOWERS]> = (0..A)
            .map(|_| std::array::from_fn(|_| rng.below(A as u64) as usize))
            .collect();
        for ctx in 0..A * A {
            let row = &mut next[ctx * A..][..A];
            let mut weights = [0f64; SYNTHETIC_BRANCHING];
            for w in &mut weights {
                *w = -(1.0 - rng.next_f64()).ln(); // exponential: a Dirichlet(1) draw
            }
            let total: f64 = weights.iter().sum();
            for w in weights {
                let c = followers[ctx % A][rng.below(SYNTHETIC_FOLLOWERS as u64) as usize];
                row[c] += (1.0 - SYNTHETIC_SMOOTHING) * w / total;
            }
        }
        // Stationary distribution over pairs by power iteration.
        let mut pi = vec![1.0 / (A * A) as f64; A * A];
        for _ in 0..10_000 {
            let mut nxt = vec![0.0; A * A];
            for (ab, &p) in pi.iter().enumerate() {
                let b = ab % A;
                for c in 0..A {
                    nxt[b * A + c] += p * next[ab * A + c];
                }
            }
            let delta: f64 = nxt.iter().zip(&pi).map(|(x, y)| (x - y).abs()).sum();
            pi = nxt;
            if delta < 1e-15 {
                break;
            }
        }
        let entropy_rate = (0..A * A)
            .map(|ab| pi[ab] * entropy(&next[ab * A..][..A]))
            .sum();
        let mut unigram = vec![0.0; A];
        for (ab, &p) in pi.iter().enumerate() {
            unigram[ab % A] += p;
        }
        // H(X_1 | X_0) = H(X_0, X_1) - H(X_0).
        let first_order_entropy = entropy(&pi) - entropy(&unigram);
        MarkovSource {
            next,
            stationary: pi,
            entropy_rate,
            first_order_entropy,
            unigram_entropy: entropy(&unigram),
        }
    }

    /// Entropy rate in nats per token: the loss floor for predictions with at least two
    /// tokens of context.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    /// `H(X_t | X_{t-1})` in nats: the best loss of a model that sees only the current token.
    pub fn first_order_entropy(&self) -> f64 {
        self.first_order_entropy
    }

    /// Entropy of a single symbol, in nats: the best loss of a model that ignores context.
    pub fn unigram_entropy(&self) -> f64 {
        self.unigram_entropy
    }

    /// Best achievable mean loss over a sample of `seq` predictions: the first prediction
    /// sees one token of context, the others at least two.
    pub fn loss_floor(&self, seq: usize) -> f64 {
        if seq == 0 {
            return 0.0;
        }
        (self.first_order_entropy + (seq - 1) as f64 * self.entropy_rate) / seq as f64
    }

    fn sample(&self, rng: &mut Rng, out: &mut [u32]) {
        const A: usize = SYNTHETIC_ALPHABET.len();
        let draw = |rng: &mut Rng, p: &[f64]| -> usize {
            let mut u = rng.next_f64();
            for (i, &pi) in p.iter().enumerate() {
                if u < pi {
                    return i;
                }
                u -= pi;
            }
            p.len() - 1
        };
        let ab = draw(rng, &self.stationary);
        let (mut a, mut b) = (ab / A, ab % A);
        for (i, o) in out.iter_mut().enumerate() {
            let sym = match i {
                0 => a,
                1 => b,
                _ => {
                    let c = draw(rng, &self.next[(a * A + b) * A..][..A]);
                    (a, b) = (b, c);
                    c
                }
            };
            *o = SYNTHETIC_ALPHABET[sym] as u32;
        }
    }
}

/// A data file's tokens (a UTF-8 text file as byte tokens, or an llm.c token shard), cut into
/// windows that are visited in a seeded order.
#[derive(Clone, Debug)]
pub struct TextCorpus {
    path: PathBuf,
    tokens: Vec<u32>,
    vocab: usize,
}

impl TextCorpus {
    /// Reads a token shard (`shoal data prepare`, llm.c) or a UTF-8 text file.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Unreadable {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &bytes)
    }

    /// [`TextCorpus::open`] of the file's `bytes`, read from `path` (what errors name).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, DataError> {
        if let Some(shard) = read_shard(path, bytes) {
            let (tokens, vocab) = shard?;
            return Ok(TextCorpus {
                path: path.to_owned(),
                tokens,
                vocab,
            });
        }
        if let Err(e) = std::str::from_utf8(bytes) {
            return Err(DataError::NotText {
                path: path.to_owned(),
                offset: e.valid_up_to(),
            });
        }
        Ok(TextCorpus {
            path: path.to_owned(),
            tokens: bytes.iter().map(|&b| b as u32).collect(),
            vocab: BYTE_VOCAB,
        })
    }

    /// Builds a corpus from text in memory.
    pub fn from_text(name: &str, text: &str) -> Self {
        TextCorpus {
            path: PathBuf::from(name),
            tokens: encode(text),
            vocab: BYTE_VOCAB,
        }
    }

    /// The size of the vocabulary its tokens are ids of.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// `len` tokens from `start` (fewer at the end).
    pub fn window(&self, start: usize, len: usize) -> &[u32] {
        let start = start.min(self.tokens.len());
        &self.tokens[start..(start + len).min(self.tokens.len())]
    }

    /// Tokens in the corpus.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the corpus has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Where samples come from.
#[derive(Clone, Debug)]
pub enum Corpus {
    /// The built-in synthetic source.
    Synthetic(Box<MarkovSource>),
    /// A text file.
    Text(TextCorpus),
}

impl Corpus {
    /// The built-in corpus generated from `seed`.
    pub fn synthetic(seed: u64) -> Self {
        Corpus::Synthetic(Box::new(MarkovSource::new(seed)))
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        match self {
            Corpus::Synthetic(_) => "synthetic (order-2 Markov source)".into(),
            Corpus::Text(t) if t.vocab == BYTE_VOCAB => {
                format!("{} ({} bytes)", t.path.display(), t.tokens.len())
            }
            Corpus::Text(t) => format!(
                "{} ({} tokens of a vocabulary of {})",
                t.path.display(),
                t.tokens.len(),
                t.vocab
            ),
        }
    }

    /// The size of the vocabulary its tokens are ids of: a model trained on it has this one.
    pub fn vocab(&self) -> usize {
        match self {
            Corpus::Synthetic(_) => BYTE_VOCAB,
            Corpus::Text(t) => t.vocab,
        }
    }

    /// The best achievable mean loss at sequence length `seq`, when known.
    pub fn loss_floor(&self, seq: usize) -> Option<f64> {
        match self {
            Corpus::Synthetic(m) => Some(m.loss_floor(seq)),
            Corpus::Text(_) => None,
        }
    }

    /// Checks that samples of `seq` predictions can be drawn.
    pub fn check_seq(&self, seq: usize) -> Result<(), DataError> {
        match self {
            Corpus::Text(t) if t.tokens.len() < seq + 1 => Err(DataError::TooShort {
                path: t.path.clone(),
                bytes: t.tokens.len(),
                needed: seq + 1,
            }),
            _ => Ok(()),
        }
    }

    /// Writes sample `index` (`out.len()` = seq + 1 tokens) for data seed `seed`.
    /// [`Corpus::check_seq`] must have accepted the length.
    pub fn sample(&self, seed: u64, index: u64, out: &mut [u32]) {
        match self {
            Corpus::Synthetic(m) => {
                let mut rng = Rng::new(derive_seed(seed, &[index]));
                m.sample(&mut rng, out);
            }
            Corpus::Text(t) => {
                // Windows start every `seq` tokens (targets of consecutive windows tile the
                // text); each epoch visits all of them in an order drawn from the seed, by an
                // affine bijection `j -> (a*j + c) mod w` with `a` coprime to `w`.
                let seq = out.len() - 1;
                let windows = ((t.tokens.len() - 1) / seq).max(1) as u64;
                let (epoch, j) = (index / windows, index % windows);
                let mut rng = Rng::new(derive_seed(seed, &[epoch]));
                let mut a = rng.below(windows).max(1);
                while gcd(a, windows) != 1 {
                    a += 1;
                }
                let c = rng.below(windows);
                let window = ((a as u128 * j as u128 + c as u128) % windows as u128) as usize;
                let start = (window * seq).min(t.tokens.len() - out.len());
                out.copy_from_slice(&t.tokens[start..start + out.len()]);
            }
        }
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Which part of the sample stream a data driver reads: samples `i ≡ index (mod count)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This shard.
    pub index: u64,
    /// Number of shards.
    pub count: u64,
}

impl Shard {
    /// All samples.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    /// Shard `index` of `count`.
    pub fn new(index: u64, count: u64) -> Result<Self, DataError> {
        if count == 0 || index >= count {
            return Err(DataError::NoSuchShard { index, count });
        }
        Ok(Shard { index, count })
    }
}

/// A batch of samples: inputs and targets, each `(batch, seq)`, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Input tokens.
    pub inputs: Vec<u32>,
    /// Next-token targets.
    pub targets: Vec<u32>,
}

/// Reads consecutive batches of one shard.
#[derive(Clone, Debug)]
pub struct DataLoader {
    corpus: Corpus,
    seed: u64,
    shard: Shard,
    seq: usize,
    /// Samples of this shard consumed so far.
    position: u64,
}

impl DataLoader {
    /// A loader of samples of `seq` predictions from `shard`.
    pub fn new(corpus: Corpus, seed: u64, shard: Shard, seq: usize) -> Result<Self, DataError> {
        corpus.check_seq(seq)?;
        Ok(DataLoader {
            corpus,
            seed,
            shard,
            seq,
            position: 0,
        })
    }

    /// The corpus.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Samples of this shard consumed so far (to resume at the same place).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Continues from a saved position.
    pub fn seek(&mut self, position: u64) {
        self.position = position;
    }

    /// Global index of this shard's `k`-th sample.
    pub fn global_index(&self, k: u64) -> u64 {
        self.shard.index + k * self.shard.count
    }

    /// The next `batch` samples.
    pub fn next_batch(&mut self, batch: usize) -> Batch {
        let seq = self.seq;
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        let mut sample = vec![0u32; seq + 1];
        for _ in 0..batch {
            let index = self.global_index(self.position);
            self.position += 1;
            self.corpus.sample(self.seed, index, &mut sample);
            inputs.extend_from_slice(&sample[..seq]);
            targets.extend_from_slice(&sample[1..]);
        }
        Batch {
            batch,
            seq,
            inputs,
            targets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_shards_read_back_and_bad_ones_say_why() {
        let dir = std::env::temp_dir().join(format!("shoal-shard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.bin");
        let tokens: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
        write_shard(&path, &tokens, GPT2_VOCAB).unwrap();
        let c = TextCorpus::open(&path).unwrap();
        assert_eq!((c.vocab(), c.len()), (GPT2_VOCAB, 1000));
        assert_eq!(c.window(990, 20), &tokens[990..]);
        write_shard(&path, &[1, 2, 255], BYTE_VOCAB).unwrap();
        assert_eq!(TextCorpus::open(&path).unwrap().vocab(), BYTE_VOCAB);
        // Truncated, a token outside the vocabulary, another version: refused, saying which.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.pop();
        std::fs::write(&path, &bytes).unwrap();
        let e = TextCorpus::open(&path).unwrap_err().to_string();
        assert!(e.contains("the header says 3 tokens"), "{e}");
        write_shard(&path, &[300], BYTE_VOCAB).unwrap();
        let e = TextCorpus::open(&path).unwrap_err().to_string();
        assert!(e.contains("token 300 outside"), "{e}");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4] = 7;
        std::fs::write(&path, &bytes).unwrap();
        let e = TextCorpus::open(&path).unwrap_err().to_string();
        assert!(e.contains("version 7"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    use std::collections::HashSet;

    #[test]
    fn synthetic_source_has_consistent_entropies() {
        let m = MarkovSource::new(1);
        let (h2, h1, h0) = (m.entropy_rate(), m.first_order_entropy, m.unigram_entropy());
        // Conditioning never increases entropy, and the source has real structure.
        assert!(h2 < h1 && h1 < h0, "{h2} {h1} {h0}");
        assert!(h0 <= (32f64).ln() + 1e-9);
        assert!(
            h2 > 0.3 && h0 - h1 > 0.5 && h1 - h2 > 0.3,
            "rate {h2}, h1 {h1}, unigram {h0}"
        );
        // The empirical per-token log-loss of the true model matches the entropy rate.
        const A: usize = 32;
        let idx = |t: u32| {
            SYNTHETIC_ALPHABET
                .iter()
                .position(|&c| c as u32 == t)
                .unwrap()
        };
        let corpus = Corpus::Synthetic(Box::new(m.clone()));
        let mut nll = 0.0;
        let mut count = 0;
        let mut s = vec![0u32; 65];
        for i in 0..2000 {
            corpus.sample(9, i, &mut s);
            for w in s.windows(3) {
                let (a, b, c) = (idx(w[0]), idx(w[1]), idx(w[2]));
                nll -= m.next[(a * A + b) * A + c].ln();
                count += 1;
            }
        }
        let empirical = nll / count as f64;
        assert!(
            (empirical - h2).abs() < 0.02,
            "empirical {empirical} vs rate {h2}"
        );
    }

    #[test]
    fn samples_are_deterministic_and_shards_disjoint() {
        let corpus = Corpus::synthetic(3);
        let mut a = DataLoader::new(corpus.clone(), 5, Shard::new(0, 2).unwrap(), 16).unwrap();
        let mut b = DataLoader::new(corpus.clone(), 5, Shard::new(1, 2).unwrap(), 16).unwrap();
        let mut a2 = DataLoader::new(corpus, 5, Shard::new(0, 2).unwrap(), 16).unwrap();
        let ba = a.next_batch(8);
        assert_eq!(ba, a2.next_batch(8));
        let bb = b.next_batch(8);
        let rows_a: HashSet<_> = ba.inputs.chunks(16).collect();
        assert!(bb.inputs.chunks(16).all(|r| !rows_a.contains(r)));
        assert_eq!(&ba.inputs[1..16], &ba.targets[..15]);
        assert!(Shard::new(2, 2).is_err() && Shard::new(0, 0).is_err());
    }

    #[test]
    fn text_windows_cover_the_file_each_epoch() {
        let mut rng = Rng::new(4);
        let text: String = (0..1000)
            .map(|_| (b'a' + rng.below(26) as u8) as char)
            .collect();
        let corpus = Corpus::Text(TextCorpus::from_text("t", &text));
        let seq = 10;
        let windows = (text.len() - 1) / seq;
        let mut starts = HashSet::new();
        let mut s = vec![0u32; seq + 1];
        for i in 0..windows as u64 {
            corpus.sample(1, i, &mut s);
            starts.insert(s.clone());
        }
        assert_eq!(starts.len(), windows, "every window once per epoch");
        assert!(matches!(
            Corpus::Text(TextCorpus::from_text("t", "short")).check_seq(10),
            Err(DataError::TooShort { .. })
        ));
        assert_eq!(decode(&encode("héllo")), "héllo");
    }
}
