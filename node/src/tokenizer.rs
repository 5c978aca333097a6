//! Tokenizers: bytes (one token per byte, vocabulary 256) and GPT-2's BPE (`r50k_base` from
//! `tiktoken-rs`, whose vocabulary ships in the crate: nothing is downloaded), and
//! `shoal data prepare`, which writes text as llm.c token shards.

use crate::cli::DataPrepareArgs;
use anyhow::{Context, bail};
use shoal_compute::data::{BYTE_VOCAB, GPT2_VOCAB, write_shard};
use std::path::PathBuf;

/// A tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Tokenizer {
    /// GPT-2's byte-pair encoding (50,257 tokens).
    Gpt2,
    /// One token per byte (256 tokens).
    Bytes,
}

/// GPT-2's end-of-text token, written before each document.
const GPT2_EOT: u32 = 50256;

impl Tokenizer {
    /// The tokenizer whose vocabulary has `vocab` tokens, if shoal has one.
    pub fn for_vocab(vocab: usize) -> Option<Tokenizer> {
        match vocab {
            GPT2_VOCAB => Some(Tokenizer::Gpt2),
            BYTE_VOCAB => Some(Tokenizer::Bytes),
            _ => None,
        }
    }

    pub fn vocab(self) -> usize {
        match self {
            Tokenizer::Gpt2 => GPT2_VOCAB,
            Tokenizer::Bytes => BYTE_VOCAB,
        }
    }

    /// The tokens of `text`.
    pub fn encode(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    /// The text of `tokens` (bytes that are not UTF-8 replaced).
    pub fn decode(self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = match self {
            // Ids outside the vocabulary would panic the decoder: they become `?`.
            Tokenizer::Gpt2 => tokens
                .iter()
                .flat_map(|&t| {
                    if (t as usize) < GPT2_VOCAB {
                        tiktoken_rs::r50k_base_singleton()
                            ._decode_native_and_split(vec![t])
                            .flatten()
                            .collect::<Vec<u8>>()
                    } else {
                        vec![b'?']
                    }
                })
                .collect(),
            Tokenizer::Bytes => tokens
                .iter()
                .map(|t| u8::try_from(*t).unwrap_or(b'?'))
                .collect(),
        };
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A document's tokens as a shard holds them: GPT-2's with the end-of-text token before
    /// it (as llm.c writes them), bytes as they are.
    fn document(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Gpt2 => std::iter::once(GPT2_EOT).chain(self.encode(text)).collect(),
            Tokenizer::Bytes => self.encode(text),
        }
    }
}

/// `shoal data prepare`: text files as a training and a validation shard.
pub fn prepare(args: DataPrepareArgs) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&args.val_fraction) {
        bail!(
            "--val-fraction {} must be at least 0 and below 1",
            args.val_fraction
        );
    }
    let mut tokens = Vec::new();
    for path in &args.inputs {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        tokens.extend(args.tokenizer.document(&text));
    }
    let val = (tokens.len() as f64 * args.val_fraction).round() as usize;
    let train = tokens.len() - val;
    if train == 0 {
        bail!("no tokens to train on");
    }
    let stem = args.output.to_string_lossy();
    let stem = stem.strip_suffix(".bin").unwrap_or(&stem);
    let (train_path, val_path) = (
        PathBuf::from(format!("{stem}_train.bin")),
        PathBuf::from(format!("{stem}_val.bin")),
    );
    let vocab = args.tokenizer.vocab();
    if let Some(dir) = train_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    write_shard(&train_path, &tokens[..train], vocab)
        .with_context(|| format!("cannot write {}", train_path.display()))?;
    println!("{}: {train} tokens", train_path.display());
    if val > 0 {
        write_shard(&val_path, &tokens[train..], vocab)
            .with_context(|| format!("cannot write {}", val_path.display()))?;
        println!("{}: {val} tokens (validation)", val_path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_tokens_are_gpt2s() {
        let t = Tokenizer::Gpt2;
        // "Hello world" in GPT-2's vocabulary.
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        assert_eq!(t.decode(&t.encode("naïve café")), "naïve café");
        assert_eq!(t.document("a")[0], GPT2_EOT);
        assert_eq!(
            Tokenizer::Bytes.decode(&Tokenizer::Bytes.encode("hé")),
            "hé"
        );
        assert_eq!(Tokenizer::for_vocab(50257), Some(Tokenizer::Gpt2));
    }
}
