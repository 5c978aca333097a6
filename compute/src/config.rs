//! Model shapes: the named presets and what follows from them (parameter counts, FLOPs).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The shape of a GPT-2 style decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Number of token ids (256 for the byte tokenizer).
    pub vocab: usize,
    /// Longest sequence the position embedding covers.
    pub context: usize,
    /// Width of the residual stream (channels).
    pub width: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Attention heads per block; must divide `width`.
    pub heads: usize,
}

/// The named model sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// 2 layers of width 64: tests and quick demos.
    Nano,
    /// 6 layers of width 256: learns the synthetic corpus to near its floor on a CPU.
    Micro,
    /// 8 layers of width 512, context 256.
    Mini,
    /// GPT-2 small (124M parameters with the GPT-2 vocabulary): GPU-class.
    Gpt2,
    /// GPT-2 XL's shape (1.56B parameters: 48 layers of width 1600): for modelled swarms of
    /// volunteer GPUs at the size where pipelining is needed.
    Gpt2Xl,
}

impl Preset {
    /// All presets, smallest first.
    pub const ALL: [Preset; 5] = [
        Preset::Nano,
        Preset::Micro,
        Preset::Mini,
        Preset::Gpt2,
        Preset::Gpt2Xl,
    ];

    /// The preset's name as used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Nano => "nano",
            Preset::Micro => "micro",
            Preset::Mini => "mini",
            Preset::Gpt2 => "gpt2",
            Preset::Gpt2Xl => "gpt2-xl",
        }
    }

    /// A peak learning rate that trains this preset well with AdamW (smaller models tolerate
    /// larger steps), found by sweeps on the built-in corpus.
    pub fn default_lr(self) -> f32 {
        match self {
            Preset::Nano => 3e-3,
            Preset::Micro => 1e-3,
            Preset::Mini | Preset::Gpt2 => 6e-4,
            // Not swept: the rate GPT-3's authors used at this size.
            Preset::Gpt2Xl => 2e-4,
        }
    }

    /// The model shape of this preset.
    pub fn config(self) -> ModelConfig {
        let (vocab, context, width, layers, heads) = match self {
            Preset::Nano => (256, 64, 64, 2, 4),
            Preset::Micro => (256, 128, 256, 6, 8),
            Preset::Mini => (256, 256, 512, 8, 8),
            Preset::Gpt2 => (50257, 1024, 768, 12, 12),
            Preset::Gpt2Xl => (50257, 1024, 1600, 48, 25),
        };
        ModelConfig {
            vocab,
            context,
            width,
            layers,
            heads,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                format!("unknown preset '{s}' (known: {})", known.join(", "))
            })
    }
}

impl ModelConfig {
    /// Channels per attention head.
    pub fn head_dim(&self) -> usize {
        self.width / self.heads
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> Result<(), String> {
        if self.vocab == 0 || self.context == 0 || self.width == 0 || self.layers == 0 {
            return Err("model dimensions must be positive".into());
        }
        if self.heads == 0 || !self.width.is_multiple_of(self.heads) {
            return Err(format!(
                "{} heads do not divide width {}",
                self.heads, self.width
            ));
        }
        Ok(())
    }

    /// Parameters of one transformer block.
    pub fn block_params(&self) -> usize {
        let c = self.width;
        // ln1 + qkv + attention projection + ln2 + fc + fc projection, weights and biases.
        2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * c + (4 * c * c + 4 * c) + (4 * c * c + c)
    }

    /// Unique parameters of the whole model (the tied embedding counted once).
    pub fn params(&self) -> usize {
        self.vocab * self.width
            + self.context * self.width
            + self.layers * self.block_params()
            + 2 * self.width
    }

    /// FLOPs of one training step (forward + backward) per token at sequence length `seq`:
    /// 6 per weight (matrix products, including the tied head) plus the attention products
    /// (QK^T and AV: 4 * seq * width per layer forward, causal masking not discounted).
    /// Elementwise work is not counted, as is customary.
    pub fn train_flops_per_token(&self, seq: usize) -> f64 {
        let matmul_weights = self.layers * 12 * self.width * self.width + self.vocab * self.width;
        let attention = self.layers * 4 * seq * self.width;
        3.0 * (2.0 * matmul_weights as f64 + attention as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_shapes() {
        let m = Preset::Micro.config();
        assert_eq!(
            (m.vocab, m.context, m.width, m.layers, m.heads),
            (256, 128, 256, 6, 8)
        );
        for p in Preset::ALL {
            p.config().validate().unwrap();
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
        // GPT-2 small with the GPT-2 vocabulary is the well-known 124M.
        let g = Preset::Gpt2.config().params();
        assert_eq!(g, 124_439_808);
        // GPT-2 XL: the well-known 1.5B (1,557,611,200 with its vocabulary).
        assert_eq!(Preset::Gpt2Xl.config().params(), 1_557_611_200);
        let e = "huge".parse::<Preset>().unwrap_err();
        assert!(e.contains("gpt2-xl"), "{e}");
    }
}
