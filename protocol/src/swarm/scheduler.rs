//! The device's queue of compute jobs: which job runs next, and how fast this peer trains.
//!
//! A peer's device runs one job at a time. Jobs wait in four queues by priority and run first
//! come, first served within a queue. The time the device spends on microbatches, against the
//! samples it commits, is the peer's measured throughput: what it announces, what routing
//! weighs and what rebalancing plans with.

use super::interface::Job;
use std::collections::VecDeque;
use std::time::Duration;

/// Which kind of job is running, so that its result can be attributed when it comes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Running {
    /// A forward or backward pass of this attempt.
    Microbatch(u64),
    /// A held-out forward pass of this attempt (an evaluation): it commits nothing, so its
    /// time is not the throughput's.
    HeldOut(u64),
    /// The commit of this attempt's gradient.
    Commit(u64),
    /// An export of the stage's state.
    Export,
    /// Anything else (state work, steps, averaging contributions).
    Other,
}

/// Weight of a new throughput measurement in the moving average: recent enough to follow a
/// device that slows down, smooth enough that one busy interval does not swing routing.
const THROUGHPUT_WEIGHT: f64 = 0.3;

/// Device seconds a throughput measurement needs at least; fewer say more about timer jitter
/// than about the device.
const MIN_MEASURED_S: f64 = 0.05;

/// The job queue and the throughput measurement.
#[derive(Debug, Default)]
pub(super) struct Scheduler {
    queues: [VecDeque<Job>; 4],
    running: Option<(Duration, Running)>,
    /// Device seconds spent on microbatch passes since the last measurement.
    busy_s: f64,
    /// Samples committed since the last measurement.
    rows_done: f64,
    /// Samples per second, a moving average (0: not measured yet).
    throughput: f64,
}

/// The queue a job waits in (0 runs first). State work, steps and averaging contributions
/// come first: the whole stage waits for them. Then commits and aborts, which are cheap and
/// free memory; then backward passes, which finish work already half done and hold a
/// driver's round trip; forward passes, which start new work, come last.
fn priority(job: &Job) -> usize {
    match job {
        Job::Commit { .. } | Job::Abort { .. } => 1,
        Job::Backward { .. } => 2,
        Job::Forward { .. } => 3,
        _ => 0,
    }
}

impl Scheduler {
    /// Queues a job.
    pub fn enqueue(&mut self, job: Job) {
        self.queues[priority(&job)].push_back(job);
    }

    /// The job to run now, if the device is free and a job waits.
    pub fn next(&mut self, now: Duration) -> Option<Job> {
        if self.running.is_some() {
            return None;
        }
        let job = self.queues.iter_mut().find_map(VecDeque::pop_front)?;
        let running = match &job {
            Job::Forward {
                id, held_out: true, ..
            } => Running::HeldOut(*id),
            Job::Forward { id, .. } | Job::Backward { id, .. } => Running::Microbatch(*id),
            Job::Commit { id } => Running::Commit(*id),
            Job::Export { .. } => Running::Export,
            _ => Running::Other,
        };
        self.running = Some((now, running));
        Some(job)
    }

    /// The running job finished: what it was. Time spent on microbatch passes counts toward
    /// the throughput measurement.
    pub fn finished(&mut self, now: Duration) -> Running {
        match self.running.take() {
            Some((started, running)) => {
                if matches!(running, Running::Microbatch(_)) {
                    self.busy_s += now.saturating_sub(started).as_secs_f64();
                }
                running
            }
            None => Running::Other,
        }
    }

    /// Jobs waiting or running.
    pub fn queued(&self) -> u32 {
        let waiting: usize = self.queues.iter().map(VecDeque::len).sum();
        waiting as u32 + u32::from(self.running.is_some())
    }

    /// Forgets the queued microbatch work (forward, backward and commit jobs): the stage it
    /// was for is being replaced. Aborts stay, they free the replica's memory.
    pub fn drop_microbatch_work(&mut self) {
        for q in &mut self.queues {
            q.retain(|j| {
                !matches!(
                    j,
                    Job::Forward { .. } | Job::Backward { .. } | Job::Commit { .. }
                )
            });
        }
    }

    /// Samples whose gradient this peer committed.
    pub fn count_rows(&mut self, rows: u32) {
        self.rows_done += f64::from(rows);
    }

    /// Folds what was done since the last call into the throughput, once there is enough of
    /// it to measure.
    pub fn measure(&mut self) {
        if self.busy_s > MIN_MEASURED_S && self.rows_done > 0.0 {
            let sample = self.rows_done / self.busy_s;
            self.throughput = if self.throughput > 0.0 {
                (1.0 - THROUGHPUT_WEIGHT) * self.throughput + THROUGHPUT_WEIGHT * sample
            } else {
                sample
            };
            self.busy_s = 0.0;
            self.rows_done = 0.0;
        }
    }

    /// Measured samples per second (0: not measured yet).
    pub fn throughput(&self) -> f64 {
        self.throughput
    }

    /// Device seconds a sample takes: from the measured throughput, or before there is one,
    /// from what was done so far (a device that is mostly idle takes long to measure, and its
    /// links need a choice of codec meanwhile). None when nothing was done yet.
    pub fn seconds_per_sample(&self) -> Option<f64> {
        if self.throughput > 0.0 {
            Some(1.0 / self.throughput)
        } else {
            (self.rows_done > 0.0).then(|| self.busy_s / self.rows_done)
        }
    }

    /// Starts measuring again from nothing (the peer serves another stage, whose cost
    /// differs): what was done for the old stage must not be counted for the new one.
    pub fn forget_throughput(&mut self) {
        self.throughput = 0.0;
        self.busy_s = 0.0;
        self.rows_done = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::interface::Input;

    const MS: Duration = Duration::from_millis(1);

    fn forward(id: u64) -> Job {
        Job::Forward {
            id,
            rows: 1,
            sample: 0,
            input: Input::Tokens,
            held_out: false,
        }
    }

    fn backward(id: u64) -> Job {
        Job::Backward {
            id,
            grad: None,
            rows: 1,
        }
    }

    #[test]
    fn state_work_then_commits_then_backward_then_forward() {
        let mut s = Scheduler::default();
        s.enqueue(forward(1));
        s.enqueue(backward(2));
        s.enqueue(forward(3));
        s.enqueue(Job::Commit { id: 4 });
        s.enqueue(Job::LocalStep);
        s.enqueue(Job::Abort { id: 5 });
        s.enqueue(backward(6));
        assert_eq!(s.queued(), 7);
        let mut order = Vec::new();
        while let Some(job) = s.next(Duration::ZERO) {
            order.push(job);
            s.finished(Duration::ZERO);
        }
        assert_eq!(
            order,
            [
                Job::LocalStep,
                Job::Commit { id: 4 },
                Job::Abort { id: 5 },
                backward(2),
                backward(6),
                forward(1),
                forward(3)
            ]
        );
    }

    #[test]
    fn one_job_at_a_time_and_results_are_attributed() {
        let mut s = Scheduler::default();
        s.enqueue(forward(1));
        s.enqueue(Job::Commit { id: 1 });
        assert_eq!(s.next(Duration::ZERO), Some(Job::Commit { id: 1 }));
        assert_eq!(s.next(Duration::ZERO), None, "the device is busy");
        assert_eq!(s.queued(), 2, "one running, one waiting");
        assert_eq!(s.finished(MS), Running::Commit(1));
        assert_eq!(s.next(MS), Some(forward(1)));
        assert_eq!(s.finished(2 * MS), Running::Microbatch(1));
        assert_eq!(s.finished(2 * MS), Running::Other, "nothing was running");
    }

    #[test]
    fn throughput_counts_microbatch_time_only_and_follows_the_device() {
        let mut s = Scheduler::default();
        // 100 ms of forward passes and a 1 s step: 10 samples in 0.1 s of microbatch work.
        s.enqueue(forward(1));
        s.next(Duration::ZERO);
        s.finished(100 * MS);
        s.enqueue(Job::LocalStep);
        s.next(100 * MS);
        s.finished(1100 * MS);
        s.count_rows(10);
        s.measure();
        assert!((s.throughput() - 100.0).abs() < 1e-9, "{}", s.throughput());
        // Too little device time says nothing: the measurement waits.
        s.enqueue(forward(2));
        s.next(Duration::ZERO);
        s.finished(10 * MS);
        s.count_rows(10);
        s.measure();
        assert!((s.throughput() - 100.0).abs() < 1e-9);
        // The device got twice as slow: the estimate moves toward it without jumping there.
        s.enqueue(forward(3));
        s.next(Duration::ZERO);
        s.finished(190 * MS);
        s.count_rows(0);
        s.measure();
        let t = s.throughput();
        assert!(t < 100.0 && t > 50.0, "{t}");
        // Another stage: nothing measured for the old one carries over.
        s.enqueue(forward(4));
        s.next(Duration::ZERO);
        s.finished(40 * MS);
        s.count_rows(10);
        s.forget_throughput();
        s.measure();
        assert_eq!(s.throughput(), 0.0);
    }

    #[test]
    fn replacing_the_stage_drops_its_microbatch_work_but_not_aborts_or_state_work() {
        let mut s = Scheduler::default();
        s.enqueue(forward(1));
        s.enqueue(backward(2));
        s.enqueue(Job::Commit { id: 3 });
        s.enqueue(Job::Abort { id: 4 });
        s.enqueue(Job::Init { stage: 0 });
        s.drop_microbatch_work();
        assert_eq!(s.next(Duration::ZERO), Some(Job::Init { stage: 0 }));
        s.finished(Duration::ZERO);
        assert_eq!(s.next(Duration::ZERO), Some(Job::Abort { id: 4 }));
        s.finished(Duration::ZERO);
        assert_eq!(s.next(Duration::ZERO), None);
    }
}
