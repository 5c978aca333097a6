//! `shoal netsim`: simulate a scenario, show progress in simulated time, print the summary,
//! write the report and the plot.

use crate::cli::NetsimArgs;
use crate::report;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use shoal_netsim::{Scenario, simulate};
use std::time::Instant;

pub fn run(args: NetsimArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.scenario)
        .with_context(|| format!("cannot read {}", args.scenario.display()))?;
    let setup =
        Scenario::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", args.scenario.display()))?;
    let name = args
        .scenario
        .file_stem()
        .map_or("scenario".into(), |s| s.to_string_lossy().into_owned());
    let peers: u32 = setup.groups.iter().map(|g| g.count).sum();
    println!(
        "netsim {name} (seed {}): {} in {} stages, {} sync, {} peers at start, {} steps",
        args.seed,
        setup.config.preset,
        setup.config.stages,
        setup.config.sync,
        peers,
        setup.config.max_steps
    );
    let bar = ProgressBar::new(setup.config.max_steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} step {pos}/{len}  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let wall = Instant::now();
    let report = simulate(setup, args.seed, &mut |p| {
        bar.set_position(p.step);
        bar.set_message(format!("{:.1} simulated s, {} peers", p.sim_s, p.peers));
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    let wall = wall.elapsed().as_secs_f64();
    println!(
        "simulated {:.1} s in {wall:.1} s of wall time ({} events)",
        report.sim_seconds, report.events
    );
    print!("{}", report.table());
    if let Some(path) = &args.report {
        report::write_json(path, &report)?;
        println!("report: {}", path.display());
    }
    if let Some(path) = &args.plot {
        let title = format!("netsim {name}, seed {}", args.seed);
        let value = serde_json::to_value(&report)?;
        crate::plot::write(&title, &[(format!("seed {}", args.seed), value)], path)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}
