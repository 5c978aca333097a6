//! The files a run names: its training data, its held-out data and the model it starts from.
//! The run's creator names each by file name and content hash in the configuration; every
//! peer passes the same files and each is checked against its hash before anything is read,
//! so that no two peers train on different data or start from different models.

use crate::model_file::ModelFile;
use anyhow::{Context, bail};
use shoal_compute::data::{BYTE_VOCAB, SHARD_MAGIC, TextCorpus};
use shoal_compute::{AnyBackend, Corpus, ModelConfig};
use shoal_protocol::swarm::{DataSource, ModelRef, RunConfig};
use shoal_worker::InitialParams;
use std::path::Path;

/// A file's name (for messages) and its content's xxh3-64.
fn name_and_hash(path: &Path, bytes: &[u8]) -> (String, u64) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    (name, xxhash_rust::xxh3::xxh3_64(bytes))
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// A data file as the run's configuration names it: a token shard names its vocabulary,
/// text is bytes (read as training reads it).
pub(super) fn data_source(path: &Path) -> anyhow::Result<DataSource> {
    let bytes = read(path)?;
    let (name, hash) = name_and_hash(path, &bytes);
    let corpus = TextCorpus::parse(path, &bytes)?;
    let is_shard = bytes.get(..4) == Some(&SHARD_MAGIC.to_le_bytes()[..]);
    Ok(if corpus.vocab() == BYTE_VOCAB && !is_shard {
        DataSource::TextFile { name, hash }
    } else {
        DataSource::TokenShard {
            name,
            hash,
            vocab: corpus.vocab() as u32,
        }
    })
}

/// The data `source` names, read from `path` (the peer's `flag`), checked against the hash;
/// the synthetic corpus needs no file.
pub(super) fn local_corpus(
    source: &DataSource,
    path: Option<&Path>,
    flag: &str,
    seed: u64,
) -> anyhow::Result<Corpus> {
    match source {
        DataSource::Synthetic => Ok(Corpus::synthetic(seed)),
        DataSource::TextFile { name, hash } | DataSource::TokenShard { name, hash, .. } => {
            let Some(path) = path else {
                // Stage choice is the protocol's and any stage may need the data: refuse
                // clearly rather than fail on the first microbatch.
                bail!("this run reads {name}: pass the same file with {flag}");
            };
            let bytes = read(path)?;
            if xxhash_rust::xxh3::xxh3_64(&bytes) != *hash {
                bail!("{} is not the run's file {name} ({flag})", path.display());
            }
            Ok(Corpus::Text(TextCorpus::parse(path, &bytes)?))
        }
    }
}

/// The run's reference to the model file at `path`, whose shape must be `model`'s.
pub(super) fn model_ref(path: &Path, model: &ModelConfig) -> anyhow::Result<ModelRef> {
    let bytes = read(path)?;
    open_model(path, &bytes, model)?;
    let (name, hash) = name_and_hash(path, &bytes);
    Ok(ModelRef { name, hash })
}

/// The model file's tensors from `bytes` (read from `path`), whose shape must be `model`'s.
fn open_model(path: &Path, bytes: &[u8], model: &ModelConfig) -> anyhow::Result<ModelFile> {
    let file =
        ModelFile::parse(path, bytes).with_context(|| format!("--init {}", path.display()))?;
    if file.config != *model {
        bail!(
            "--init {}: the file holds a model of {} layers of width {} and vocabulary {}; the \
             run's is of {} layers of width {} and vocabulary {} (choose the preset of the \
             file's shape, and data of its vocabulary)",
            path.display(),
            file.config.layers,
            file.config.width,
            file.config.vocab,
            model.layers,
            model.width,
            model.vocab
        );
    }
    Ok(file)
}

/// What a stage built fresh starts from: the run's model file (from `path`, checked against
/// the configuration's hash), or None where the run starts from its seed.
pub(super) fn initial_params(
    config: &RunConfig,
    model: &ModelConfig,
    path: Option<&Path>,
) -> anyhow::Result<Option<InitialParams<AnyBackend>>> {
    let Some(ModelRef { name, hash }) = &config.init else {
        if let Some(path) = path {
            bail!(
                "--init {}: this run starts from its seed (its creator chooses the initial model)",
                path.display()
            );
        }
        return Ok(None);
    };
    let Some(path) = path else {
        bail!("this run starts from the model {name}: pass the same file with --init");
    };
    // Checked now, so that a wrong file is refused before the peer joins; read again when a
    // stage is built fresh, so that the whole model does not stay in host memory meanwhile.
    let load = {
        let (path, name, hash, model) = (path.to_path_buf(), name.clone(), *hash, *model);
        move || -> anyhow::Result<ModelFile> {
            let bytes = read(&path)?;
            if xxhash_rust::xxh3::xxh3_64(&bytes) != hash {
                bail!(
                    "{} is not the run's model file {name} (--init; did it change?)",
                    path.display()
                );
            }
            open_model(&path, &bytes, &model)
        }
    };
    load()?;
    Ok(Some(Box::new(move |replica| {
        load()
            .and_then(|file| file.stage_params(replica.stage()))
            .map_err(|e| format!("{e:#}"))
    })))
}
