//! `shoal`: train one transformer across many machines.
//!
//! This binary is the thin IO layer of shoal: it parses the command line, owns threads,
//! terminals and files, and drives the compute core (`shoal-compute`); protocol decisions
//! never live here. Errors reach the user as one line and a non-zero exit, never a panic.

mod bench;
mod bench_average;
mod bench_net;
mod cli;
mod config_file;
mod devices;
mod http;
mod model_file;
mod models;
mod netsim;
mod node;
mod plot;
mod report;
mod run;
mod tokenizer;
mod train;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Mesa's device-select Vulkan layer only reorders adapters (shoal chooses its own) and, on
    // a machine without a display session, prints an error whenever adapters are listed.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        // SAFETY: the first statement of main, before any other thread exists.
        unsafe { std::env::set_var("NODEVICE_SELECT", "1") };
    }
    let argv = match config_file::expand(std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("error: --config {e:#}");
            return ExitCode::from(2);
        }
    };
    let args = match cli::Cli::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(2);
            }
            // One line: clap's first line names the argument and the reason.
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: bad arguments"));
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        cli::LogFormat::Text => logs.init(),
        cli::LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    let result = match args.command {
        cli::Command::Train(a) => train::run(*a),
        cli::Command::Run(a) => run::run(*a),
        cli::Command::Node(a) => node::run(a),
        cli::Command::Bench(cli::BenchCommand::Compute(a)) => bench::compute(a),
        cli::Command::Bench(cli::BenchCommand::Codec(a)) => bench::codec(a),
        cli::Command::Bench(cli::BenchCommand::Net(a)) => bench_net::net(a),
        cli::Command::Bench(cli::BenchCommand::RobustMean(a)) => bench::robust_mean(a),
        cli::Command::Bench(cli::BenchCommand::Average(a)) => bench_average::average(a),
        cli::Command::Netsim(a) => netsim::run(a),
        cli::Command::Devices(a) => devices::run(a),
        cli::Command::Plot(a) => plot::run(a),
        cli::Command::Data(cli::DataCommand::Prepare(a)) => tokenizer::prepare(a),
        cli::Command::Eval(a) => models::eval(a),
        cli::Command::Export(a) => models::export(a),
        cli::Command::Generate(a) => models::generate(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
