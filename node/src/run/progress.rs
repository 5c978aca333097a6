//! What a running peer shows of its progress, and when it gives up for want of any.

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use shoal_protocol::swarm::Peer;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use super::Tally;

/// Watches for a run that cannot go on: no step for `limit` while some stage has no peer.
pub(super) struct Stall {
    limit: Option<Duration>,
    step: u64,
    since: Instant,
}

impl Stall {
    pub(super) fn new(seconds: f32) -> anyhow::Result<Self> {
        let limit = Duration::try_from_secs_f32(seconds)
            .with_context(|| format!("--stall-timeout {seconds}"))?;
        Ok(Stall {
            limit: (!limit.is_zero()).then_some(limit),
            step: 0,
            since: Instant::now(),
        })
    }

    /// Why the run should be given up, once it should.
    pub(super) fn check(&mut self, peer: &Peer) -> Option<String> {
        let counts = peer.stage_replicas();
        let unserved: Vec<String> = (0..counts.len())
            .filter(|s| counts[*s] == 0)
            .map(|s| s.to_string())
            .collect();
        if peer.step() != self.step || unserved.is_empty() {
            self.step = peer.step();
            self.since = Instant::now();
            return None;
        }
        let limit = self.limit?;
        (self.since.elapsed() >= limit).then(|| {
            format!(
                "no step for {:.0} s (at step {}) while no peer serves stage {}: the others left, \
                 or the run ended without this peer (--stall-timeout)",
                limit.as_secs_f64(),
                self.step,
                unserved.join(", ")
            )
        })
    }
}

/// The status line and the state download's bar while a peer runs on a terminal (drawn by
/// `indicatif`, on stdout); what else the peer prints goes above them through [`say_line`].
static BARS: std::sync::Mutex<Option<MultiProgress>> = std::sync::Mutex::new(None);

/// Prints a line: above the status bars where they are drawn, as a plain line otherwise.
pub(crate) fn say_line(line: String) {
    let bars = BARS.lock().unwrap_or_else(|e| e.into_inner());
    match bars.as_ref() {
        Some(bars) => {
            let _ = bars.println(line);
        }
        None => println!("{line}"),
    }
}

/// `println!` for a running peer: see [`say_line`].
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::run::progress::say_line(format!($($arg)*))
    };
}
pub(crate) use say;

/// The progress line: a status line on a terminal, a plain line every few seconds otherwise.
pub(super) struct Progress {
    /// The status line, on a terminal.
    status: Option<ProgressBar>,
    /// The state download under way, on a terminal.
    download: Option<ProgressBar>,
    last: Instant,
    last_done: u64,
    /// Tenths of the state download in progress already shown (not on a terminal).
    download_shown: Option<u64>,
}

impl Progress {
    pub(super) fn new() -> Self {
        let status = std::io::stdout().is_terminal().then(|| {
            let bars = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
            let status = bars.add(ProgressBar::new_spinner());
            status.set_style(
                ProgressStyle::with_template("{spinner} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            *BARS.lock().unwrap_or_else(|e| e.into_inner()) = Some(bars);
            status
        });
        Progress {
            status,
            download: None,
            last: Instant::now(),
            last_done: 0,
            download_shown: None,
        }
    }

    /// The state download's progress: a bar on a terminal, a line at every tenth otherwise (a
    /// large stage takes a while on a home link).
    pub(super) fn download(&mut self, peer: &Peer) {
        let Some((held, total)) = peer.download_progress().filter(|p| p.1 > 0) else {
            self.download_shown = None;
            if let Some(bar) = self.download.take() {
                bar.finish_and_clear();
            }
            return;
        };
        if self.status.is_some() {
            let bar = self.download.get_or_insert_with(|| {
                let bars = BARS.lock().unwrap_or_else(|e| e.into_inner());
                let bar = ProgressBar::new(total);
                bar.set_style(
                    ProgressStyle::with_template(
                        "  state download {bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                match bars.as_ref() {
                    Some(bars) => bars.add(bar),
                    None => bar,
                }
            });
            bar.set_length(total);
            bar.set_position(held);
            return;
        }
        let tenths = held * 10 / total;
        if self.download_shown.is_some_and(|t| t >= tenths) {
            return;
        }
        self.download_shown = Some(tenths);
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "state download: {}% ({:.1} of {:.1} MB)",
            tenths * 10,
            mb(held),
            mb(total)
        );
    }

    pub(super) fn maybe_print(&mut self, peer: &Peer, tally: &Tally, _start: Instant) {
        let every = if self.status.is_some() {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(5)
        };
        if self.last.elapsed() < every {
            return;
        }
        let stats = peer.stats();
        let dt = self.last.elapsed().as_secs_f64();
        let c = peer.config();
        let tokens = (stats.microbatches_done - self.last_done) * (c.microbatch * c.seq) as u64;
        self.last = Instant::now();
        self.last_done = stats.microbatches_done;
        let loss = tally
            .loss_curve
            .last()
            .map_or("-".to_string(), |(_, l)| format!("{l:.4}"));
        let counts = peer.stage_replicas();
        let replicas: Vec<String> = counts.iter().map(|n| n.to_string()).collect();
        let mut line = format!(
            "stage {}  step {}/{}  loss {}  {:.0} tok/s  peers per stage [{}]",
            peer.stage().map_or("-".into(), |s| s.to_string()),
            peer.step(),
            c.max_steps,
            loss,
            tokens as f64 / dt.max(1e-9),
            replicas.join(" ")
        );
        // Nothing trains while a stage has no replica: say which, rather than count zeros.
        let unserved: Vec<String> = (0..counts.len())
            .filter(|s| counts[*s] == 0)
            .map(|s| s.to_string())
            .collect();
        if !unserved.is_empty() {
            line.push_str(&format!(
                "  waiting: no peer serves stage {} yet",
                unserved.join(", ")
            ));
        }
        match &self.status {
            Some(bar) => {
                bar.set_message(line);
                bar.tick();
            }
            None => println!("{line}"),
        }
    }

    /// Takes the bars down (the peer is leaving): what follows prints as plain lines, and
    /// the last status stays on screen.
    pub(super) fn finish(&mut self) {
        if let Some(bar) = self.download.take() {
            bar.finish_and_clear();
        }
        if let Some(bar) = self.status.take() {
            bar.finish();
        }
        *BARS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}
