//! Models in and out of shoal: safetensors files with Hugging Face GPT-2's tensor names and
//! layout (`transformer.h.0.attn.c_attn.weight`, Conv1D weights stored input-major), so
//! PyTorch, `transformers` and NumPy read what a swarm trained, and a pretrained GPT-2 can be
//! brought in to train on.
//!
//! shoal's matrices are stored output-major (`out = x · Wᵀ`, as llm.c), GPT-2's Conv1D ones
//! input-major: they are transposed on the way. The first and last stage of a cut model each
//! train their own copy of the tied embedding (see `compute/src/stage.rs`), so a model
//! assembled from a run's stages carries `lm_head.weight` beside `transformer.wte.weight`
//! (and says `tie_word_embeddings: false` in its config); a model trained whole carries only
//! the embedding.

use anyhow::{Context, bail};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use shoal_compute::{Backend, ModelConfig, Stage, StageSpec};
use std::collections::HashMap;
use std::path::Path;

/// One tensor in the file's terms.
pub struct FileTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// How a shoal tensor appears in the file: its name, its shape there, and whether it is a
/// transposed matrix (shoal's `rows x cols` is the file's `cols x rows`).
fn file_name(
    config: &ModelConfig,
    spec: StageSpec,
    ours: &str,
) -> Option<(String, Vec<usize>, bool)> {
    let c = config.width;
    if ours == "wte" {
        // The last stage of a cut model holds its own copy: the head.
        let name = if spec.is_first() {
            "transformer.wte.weight"
        } else {
            "lm_head.weight"
        };
        return Some((name.into(), vec![config.vocab, c], false));
    }
    let direct = |name: &str, shape: Vec<usize>| Some((name.to_string(), shape, false));
    match ours {
        "wpe" => return direct("transformer.wpe.weight", vec![config.context, c]),
        "lnf_w" => return direct("transformer.ln_f.weight", vec![c]),
        "lnf_b" => return direct("transformer.ln_f.bias", vec![c]),
        _ => {}
    }
    let (layer, part) = ours.strip_prefix('h')?.split_once('.')?;
    let h = format!("transformer.h.{}", layer.parse::<usize>().ok()?);
    let (suffix, shape, transposed) = match part {
        "ln1_w" => ("ln_1.weight", vec![c], false),
        "ln1_b" => ("ln_1.bias", vec![c], false),
        "qkv_w" => ("attn.c_attn.weight", vec![c, 3 * c], true),
        "qkv_b" => ("attn.c_attn.bias", vec![3 * c], false),
        "attn_proj_w" => ("attn.c_proj.weight", vec![c, c], true),
        "attn_proj_b" => ("attn.c_proj.bias", vec![c], false),
        "ln2_w" => ("ln_2.weight", vec![c], false),
        "ln2_b" => ("ln_2.bias", vec![c], false),
        "fc_w" => ("mlp.c_fc.weight", vec![c, 4 * c], true),
        "fc_b" => ("mlp.c_fc.bias", vec![4 * c], false),
        "fc_proj_w" => ("mlp.c_proj.weight", vec![4 * c, c], true),
        "fc_proj_b" => ("mlp.c_proj.bias", vec![c], false),
        _ => return None,
    };
    Some((format!("{h}.{suffix}"), shape, transposed))
}

/// `rows x cols` row-major as `cols x rows` row-major.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for (k, x) in v[r * cols..(r + 1) * cols].iter().enumerate() {
            out[k * rows + r] = *x;
        }
    }
    out
}

/// A stage's parameters as the file's tensors (a single stage of an uncut model included).
pub fn stage_tensors<B: Backend>(stage: &Stage<B>) -> anyhow::Result<Vec<FileTensor>> {
    let config = *stage.config();
    let spec = stage.spec();
    let params = stage.download_params().map_err(anyhow::Error::msg)?;
    let mut at = 0;
    let mut out = Vec::new();
    for info in stage.tensors() {
        let values = &params[at..at + info.len];
        at += info.len;
        let Some((name, shape, transposed)) = file_name(&config, spec, &info.name) else {
            bail!("tensor {} has no GPT-2 name", info.name);
        };
        let values = if transposed {
            // Ours is the file's shape reversed.
            transpose(values, shape[1], shape[0])
        } else {
            values.to_vec()
        };
        out.push(FileTensor {
            name,
            shape,
            values,
        });
    }
    Ok(out)
}

/// The Hugging Face `GPT2Config` of a model, as JSON.
fn hf_config(config: &ModelConfig, tied: bool) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab,
        "n_positions": config.context,
        "n_ctx": config.context,
        "n_embd": config.width,
        "n_layer": config.layers,
        "n_head": config.heads,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": tied,
        "bos_token_id": config.vocab - 1,
        "eos_token_id": config.vocab - 1,
    })
}

/// Writes `tensors` (every stage of one model) to `path` as safetensors (f32), with the
/// model's shape in its metadata and a Hugging Face `config.json` beside it.
pub fn write(path: &Path, config: &ModelConfig, tensors: &[FileTensor]) -> anyhow::Result<()> {
    let tied = !tensors.iter().any(|t| t.name == "lm_head.weight");
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            Ok((
                t.name.clone(),
                TensorView::new(Dtype::F32, t.shape.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    metadata.insert("shoal_config".into(), hf_config(config, tied).to_string());
    let file = safetensors::serialize(views, Some(metadata))?;
    shoal_compute::write_atomic(path, &file)
        .with_context(|| format!("cannot write {}", path.display()))?;
    let json = path.with_file_name("config.json");
    let mut text = serde_json::to_vec_pretty(&hf_config(config, tied))?;
    text.push(b'\n');
    shoal_compute::write_atomic(&json, &text)
        .with_context(|| format!("cannot write {}", json.display()))?;
    Ok(())
}

/// A model file read: its shape and its tensors by name.
pub struct ModelFile {
    pub config: ModelConfig,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl ModelFile {
    /// Reads a GPT-2 safetensors file (shoal's, or Hugging Face's `model.safetensors` with
    /// its `config.json` beside it). Checks every tensor a model of its shape needs, with its
    /// shape, and that every value is finite.
    pub fn open(path: &Path) -> anyhow::Result<ModelFile> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(path, &bytes)
    }

    /// [`ModelFile::open`] of the file's `bytes`, read from `path` (where `config.json` is
    /// looked for, and what errors name).
    pub fn parse(path: &Path, bytes: &[u8]) -> anyhow::Result<ModelFile> {
        let file = SafeTensors::deserialize(bytes)
            .with_context(|| format!("{} is not a safetensors file", path.display()))?;
        let (_, meta) = SafeTensors::read_metadata(bytes)?;
        let config_json: serde_json::Value =
            match meta.metadata().as_ref().and_then(|m| m.get("shoal_config")) {
                Some(text) => serde_json::from_str(text)?,
                None => {
                    let beside = path.with_file_name("config.json");
                    let text = std::fs::read_to_string(&beside).with_context(|| {
                        format!(
                            "{} has no model shape and {} cannot be read",
                            path.display(),
                            beside.display()
                        )
                    })?;
                    serde_json::from_str(&text)
                        .with_context(|| format!("{} is not JSON", beside.display()))?
                }
            };
        let field = |k: &str| {
            config_json[k]
                .as_u64()
                .map(|v| v as usize)
                .with_context(|| format!("the model's config has no {k}"))
        };
        let config = ModelConfig {
            vocab: field("vocab_size")?,
            context: field("n_positions")?,
            width: field("n_embd")?,
            layers: field("n_layer")?,
            heads: field("n_head")?,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        let mut tensors = HashMap::new();
        for (name, view) in file.tensors() {
            if view.dtype() != Dtype::F32 {
                // Hugging Face's own buffers (attention masks) and other precisions.
                if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
                    continue;
                }
                bail!("{name} is {:?}: only f32 files are read", view.dtype());
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
                bail!("{name} holds {bad}");
            }
            // Hugging Face saves GPT-2 without the `transformer.` prefix.
            let name = if name.starts_with("transformer.") || name == "lm_head.weight" {
                name
            } else {
                format!("transformer.{name}")
            };
            tensors.insert(name, (view.shape().to_vec(), values));
        }
        Ok(ModelFile { config, tensors })
    }

    /// Stage `spec`'s parameters in its storage order, from the file.
    pub fn stage_params<B: Backend>(&self, stage: &Stage<B>) -> anyhow::Result<Vec<f32>> {
        let spec = stage.spec();
        let mut flat = Vec::with_capacity(stage.param_count());
        for info in stage.tensors() {
            let Some((name, shape, transposed)) = file_name(&self.config, spec, &info.name) else {
                bail!("tensor {} has no GPT-2 name", info.name);
            };
            // A model saved with a tied head has no `lm_head.weight`: the head is the
            // embedding.
            let found = self.tensors.get(&name).or_else(|| {
                (name == "lm_head.weight")
                    .then(|| self.tensors.get("transformer.wte.weight"))
                    .flatten()
            });
            let Some((have, values)) = found else {
                bail!("the file has no {name}");
            };
            if *have != shape {
                bail!("{name} is {have:?} in the file, {shape:?} in a model of this shape");
            }
            if transposed {
                flat.extend(transpose(values, shape[0], shape[1]));
            } else {
                flat.extend_from_slice(values);
            }
        }
        Ok(flat)
    }

    /// Replaces `stage`'s parameters by the file's.
    pub fn load_into<B: Backend>(&self, stage: &mut Stage<B>) -> anyhow::Result<()> {
        if *stage.config() != self.config {
            bail!(
                "the file holds a model of {}; this one is of {} (choose the preset of the file's \
                 shape)",
                shape(&self.config),
                shape(stage.config())
            );
        }
        let flat = self.stage_params(stage)?;
        stage.upload_params(&flat).map_err(anyhow::Error::msg)
    }
}

/// A model's shape in words.
fn shape(c: &ModelConfig) -> String {
    format!(
        "{} layers of width {} ({} heads, vocabulary {}, context {})",
        c.layers, c.width, c.heads, c.vocab, c.context
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_compute::{CpuBackend, Preset};
    use std::sync::Arc;

    #[test]
    fn a_cut_model_written_and_read_back_is_the_same_model() {
        let config = Preset::Nano.config();
        let backend = Arc::new(CpuBackend::new(1).unwrap());
        let stages: Vec<Stage<CpuBackend>> = (0..2)
            .map(|i| {
                Stage::new(backend.clone(), config, StageSpec { index: i, count: 2 }, 7).unwrap()
            })
            .collect();
        let tensors: Vec<FileTensor> = stages
            .iter()
            .flat_map(|s| stage_tensors(s).unwrap())
            .collect();
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        for n in [
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.attn.c_attn.weight",
            "transformer.h.1.mlp.c_proj.weight",
            "transformer.ln_f.bias",
            "lm_head.weight",
        ] {
            assert!(names.contains(&n), "{n} in {names:?}");
        }
        let qkv = tensors
            .iter()
            .find(|t| t.name == "transformer.h.0.attn.c_attn.weight")
            .unwrap();
        assert_eq!(qkv.shape, vec![64, 192]);
        let dir = std::env::temp_dir().join(format!("shoal-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        write(&path, &config, &tensors).unwrap();
        let file = ModelFile::open(&path).unwrap();
        assert_eq!(file.config, config);
        // Read into stages cut otherwise (3) and whole: the same values by name.
        for count in [1, 3] {
            for index in 0..count {
                let spec = StageSpec { index, count };
                let mut fresh = Stage::new(backend.clone(), config, spec, 99).unwrap();
                file.load_into(&mut fresh).unwrap();
                for t in stage_tensors(&fresh).unwrap() {
                    let want = tensors.iter().find(|w| w.name == t.name).unwrap();
                    assert_eq!(t.values, want.values, "{} of stage {index}/{count}", t.name);
                }
            }
        }
        // A file of another shape is refused, naming the shapes.
        let mut other = Stage::new(backend, Preset::Micro.config(), StageSpec::WHOLE, 1).unwrap();
        let e = file.load_into(&mut other).unwrap_err().to_string();
        assert!(
            e.contains("2 layers of width 64") && e.contains("6 layers"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
