//! `shoal export` (a run's stage checkpoints assembled into one GPT-2 safetensors file) and
//! `shoal generate` (text sampled from such a file).

use crate::cli::{EvalArgs, ExportArgs, GenerateArgs};
use crate::model_file::{self, ModelFile};
use crate::run::checkpoint::load_checkpoint;
use anyhow::{Context, bail};
use shoal_compute::data::TextCorpus;
use shoal_compute::rng::Rng;
use shoal_compute::stage::{MicrobatchShape, StageInput};
use shoal_compute::{CpuBackend, Stage, StageSpec};
use shoal_worker::{StageWorker, model_of};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `shoal export`.
pub fn export(args: ExportArgs) -> anyhow::Result<()> {
    // Stage -> (step, checkpoint): the latest checkpoint of each stage.
    let mut stages = BTreeMap::new();
    let mut run = None;
    for dir in &args.checkpoints {
        let Some(c) = load_checkpoint(dir)? else {
            bail!("{} holds no checkpoint", dir.display());
        };
        let id = c.config.run_id();
        match run {
            None => run = Some((id, c.config.clone())),
            Some((r, _)) if r != id => {
                bail!(
                    "{} is a checkpoint of run {id}, the others of run {r}",
                    dir.display()
                )
            }
            Some(_) => {}
        }
        let newer = stages
            .get(&c.stage)
            .is_none_or(|(step, _): &(u64, _)| c.step > *step);
        if newer {
            stages.insert(c.stage, (c.step, c));
        }
    }
    let Some((run, config)) = run else {
        bail!("no checkpoint directory given");
    };
    let missing: Vec<String> = (0..config.stages)
        .filter(|s| !stages.contains_key(s))
        .map(|s| s.to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "run {run} has {} stages: no checkpoint of stage {} among those given",
            config.stages,
            missing.join(", ")
        );
    }
    let model = model_of(&config).map_err(anyhow::Error::msg)?;
    let backend = Arc::new(shoal_compute::AnyBackend::Cpu(CpuBackend::new(0)?));
    let mut tensors = Vec::new();
    for (stage, (_, c)) in &stages {
        let mut worker =
            StageWorker::new(config.clone(), backend.clone(), None).map_err(anyhow::Error::msg)?;
        worker
            .restore(*stage, &c.state)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("stage {stage}'s checkpoint"))?;
        let replica = worker.replica().context("the restored stage")?;
        tensors.extend(model_file::stage_tensors(replica.stage())?);
    }
    model_file::write(&args.output, &model, &tensors)?;
    let steps: Vec<String> = stages
        .iter()
        .map(|(s, (step, _))| format!("stage {s} at step {step}"))
        .collect();
    let params: usize = tensors.iter().map(|t| t.values.len()).sum();
    println!(
        "exported run {run} ({}; {}) to {}: {} tensors, {} values, and config.json beside it",
        config.preset,
        steps.join(", "),
        args.output.display(),
        tensors.len(),
        params
    );
    Ok(())
}

/// `shoal eval`.
pub fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let file = ModelFile::open(&args.model)?;
    let config = file.config;
    let data = TextCorpus::open(&args.data)?;
    if data.vocab() != config.vocab {
        bail!(
            "{} holds tokens of a vocabulary of {}, the model's is {}",
            args.data.display(),
            data.vocab(),
            config.vocab
        );
    }
    let seq = args.seq.unwrap_or(config.context).min(config.context);
    let windows = ((data.len().saturating_sub(1)) / seq).min(args.windows);
    if windows == 0 {
        bail!("{} has fewer than {} tokens", args.data.display(), seq + 1);
    }
    let backend = Arc::new(args.device.open()?);
    let mut stage = Stage::new(backend, config, StageSpec::WHOLE, 0).map_err(anyhow::Error::msg)?;
    file.load_into(&mut stage)?;
    let mut sum = 0.0;
    for w in 0..windows {
        let window = data.window(w * seq, seq + 1);
        let shape = MicrobatchShape { batch: 1, seq };
        let id = w as u64;
        let out = stage
            .forward(
                id,
                shape,
                StageInput::Tokens(&window[..seq]),
                Some(&window[1..]),
            )
            .map_err(anyhow::Error::msg)?;
        stage.discard(id);
        if let shoal_compute::stage::StageOutput::Loss(l) = out {
            sum += f64::from(l);
        }
    }
    let loss = sum / windows as f64;
    println!(
        "loss {loss:.4} (perplexity {:.1}) over {windows} windows of {seq} tokens of {}",
        loss.exp(),
        args.data.display()
    );
    Ok(())
}

/// `shoal generate`.
pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let file = ModelFile::open(&args.model)?;
    let config = file.config;
    let backend = Arc::new(args.device.open()?);
    let mut stage = Stage::new(backend, config, StageSpec::WHOLE, 0).map_err(anyhow::Error::msg)?;
    file.load_into(&mut stage)?;
    // A model of a vocabulary shoal has a tokenizer for reads and writes text; others take
    // and give token ids.
    let tokenizer = crate::tokenizer::Tokenizer::for_vocab(config.vocab);
    let mut tokens: Vec<u32> = match tokenizer {
        Some(t) => t.encode(&args.prompt),
        None => args
            .prompt
            .split_whitespace()
            .map(|t| {
                t.parse::<u32>()
                    .with_context(|| format!("--prompt: {t} is not a token id"))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    if tokens.is_empty() {
        bail!("--prompt is empty");
    }
    if let Some(bad) = tokens.iter().find(|t| **t as usize >= config.vocab) {
        bail!(
            "--prompt: token {bad} outside the model's vocabulary of {}",
            config.vocab
        );
    }
    let prompt_len = tokens.len();
    let mut rng = Rng::new(args.seed);
    let vocab = config.vocab;
    let mut probabilities = Vec::new();
    for i in 0..=args.tokens {
        let window = &tokens[tokens.len().saturating_sub(config.context)..];
        let seq = window.len();
        let shape = MicrobatchShape { batch: 1, seq };
        let targets = vec![0u32; seq];
        let id = i as u64;
        stage
            .forward(id, shape, StageInput::Tokens(window), Some(&targets))
            .map_err(anyhow::Error::msg)?;
        let probs = stage
            .probabilities(id)
            .map_err(anyhow::Error::msg)?
            .context("the model's head gave no probabilities")?;
        stage.discard(id);
        if i == 0 {
            probabilities = probs.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
        }
        if i == args.tokens {
            break;
        }
        let last = &probs[(seq - 1) * vocab..seq * vocab];
        tokens.push(sample(last, args.temperature, &mut rng) as u32);
    }
    match tokenizer {
        Some(t) => println!("{}", t.decode(&tokens)),
        None => {
            let ids: Vec<String> = tokens[prompt_len..].iter().map(u32::to_string).collect();
            println!("{}", ids.join(" "));
        }
    }
    if let Some(path) = &args.probabilities {
        crate::report::write_json(path, &probabilities)?;
    }
    Ok(())
}

/// A token drawn from `probs` at `temperature` (0: the most likely).
fn sample(probs: &[f32], temperature: f32, rng: &mut Rng) -> usize {
    if temperature <= 0.0 {
        return probs
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
    }
    let weights: Vec<f64> = probs
        .iter()
        .map(|p| f64::from(p.max(0.0)).powf(1.0 / f64::from(temperature)))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        draw -= w;
        if draw <= 0.0 {
            return i;
        }
    }
    weights.len() - 1
}
