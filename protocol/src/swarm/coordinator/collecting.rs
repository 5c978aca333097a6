//! When the step being collected (allreduce) is complete: the global batch was committed here
//! and at the stage's other replicas, or what is missing will not come (the starving rule of
//! the module docs), or a leader took it out of the step.

use super::StepCoordinator;
use crate::swarm::PeerKey;
use crate::swarm::membership::Membership;
use crate::swarm::message::MemberState;
use std::time::Duration;

impl StepCoordinator {
    /// Whether this replica of `stage` begins the round of the step being collected now,
    /// counting the progress `replicas` reported; if not, when to look again is set.
    /// `next_waiting` is when the first microbatch of a later step came to wait here.
    pub(super) fn step_collected(
        &mut self,
        stage: u32,
        members: &Membership,
        replicas: &[PeerKey],
        next_waiting: Option<Duration>,
        now: Duration,
    ) -> bool {
        let mut total = self.accumulated + self.progress.reported(replicas, self.round, false);
        // What a replica that is gone (banned, left) had collected of the step was committed
        // by the drivers and will not come again. The first stage's drivers refill what one
        // of them lost; a later stage has nobody to do that, and would wait for the starving
        // rule below.
        if stage > 0 {
            total += self.progress.lost(self.round);
        }
        // A stage that lost samples (a replica died with what it had collected, or re-synced)
        // would wait forever for them: the drivers have moved on, and every sample they send
        // counts at every stage alike. The evidence is a microbatch of the next step waiting
        // here, or another stage two rounds ahead; once no sample has come for a while, the
        // stage closes its round with what it has and goes on with the microbatches it holds.
        let behind = members.iter().any(|(_, m)| {
            m.announcement.state == MemberState::Serving
                && m.announcement.stage != Some(stage)
                && m.announcement.round > self.round + 1
        });
        let evidence = next_waiting.is_some() || (behind && total > 0.0);
        let since = next_waiting.map_or(self.last_collected, |t| t.max(self.last_collected));
        // How long nothing must come. When a replica of the stage is gone, the missing
        // samples most likely went with it: once the next step's work waits here, two steps'
        // time without a sample is enough.
        let join_window = self.settings.timing.join_window;
        let quiet = match self.step_time {
            Some(t) if self.replica_lost_in.is_some_and(|r| self.round <= r + 1) => {
                (2 * t).min(join_window)
            }
            _ => join_window,
        };
        let starving = evidence && now.saturating_sub(since) >= quiet;
        // A leader that started this round without this replica took its own samples (and
        // those of any that followed it) out of the step: they will not come.
        let excluded = self.rounds.excluded_in(self.round);
        if total >= f64::from(self.settings.global_batch) || starving || excluded {
            self.starve_check = None;
            return true;
        }
        if evidence {
            self.starve_check = Some(since + quiet);
        }
        false
    }

    /// This replica contributed to a round at `now`: the time between contributions is how
    /// long a step of the stage takes (a running mean).
    pub(super) fn note_step_time(&mut self, now: Duration) {
        if let Some(at) = self.contributed_at {
            let d = now.saturating_sub(at);
            self.step_time = Some(self.step_time.map_or(d, |t| (3 * t + d) / 4));
        }
        self.contributed_at = Some(now);
    }
}
