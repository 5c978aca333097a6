//! Getting a stage's state: picking replicas to download it from, the download's deadlines
//! and sources (see [`crate::swarm::transfer`]), re-syncs after a hash vote, and serving the
//! state once built. What happens to the stage's work in progress when its state is
//! replaced is here too.

use super::Peer;
use crate::swarm::PeerKey;
use crate::swarm::agreement::{self, Resync};
use crate::swarm::exports::At;
use crate::swarm::interface::{Event, Job};
use crate::swarm::message::StateChunk;
use crate::swarm::role::ChunkOutcome;
use crate::swarm::service::Service;
use crate::swarm::transfer::{MAX_SOURCES, RACING_SOURCES};
use std::time::Duration;

impl Peer {
    /// Starts downloading `stage`'s state from several of its replicas (see
    /// [`Self::pick_sources`]; `avoid`: one whose state was refused), or builds it fresh if
    /// it has none.
    pub(super) fn sync_from_someone(&mut self, stage: u32, avoid: Option<PeerKey>, now: Duration) {
        let sources = self.pick_sources(stage, avoid, now);
        if self.role.stage().is_some_and(|s| s != stage) {
            self.bans.left_stage();
            self.steps.left_stage();
            self.witness = Default::default();
        }
        self.start_sync(stage, &sources, now);
        if sources.is_empty() {
            if self.holds == Some(stage) {
                // A replica that must re-sync with nobody left to sync from keeps what it
                // trained, at its step: starting over from the seed would throw the stage's
                // training away.
                self.out.compute(Job::Restart { stage });
            } else {
                self.steps.set_position(0, 0, false);
                self.out.compute(Job::Init { stage });
            }
        }
        self.announce();
    }

    /// Drops the stage's work in progress and starts getting its state from `sources`.
    pub(super) fn start_sync(&mut self, stage: u32, sources: &[PeerKey], now: Duration) {
        self.abandon_stage_work();
        let resync = self.role.serving() == Some(stage);
        self.steps.set_elders(self.members.replicas(stage), resync);
        let size = (
            self.costs.max_state_bytes(stage as usize),
            self.costs.state_chunk_bytes(),
        );
        let timeout = self.timing.transfer_timeout;
        for (k, m) in self.role.sync(stage, sources, size, now, timeout) {
            self.out.send(k, m);
        }
    }

    /// Up to [`MAX_SOURCES`] of `stage`'s vouched replicas picked at random ([`RACING_SOURCES`]
    /// in DiLoCo, whose replicas' states differ, so one serves), not already sources: other
    /// than `avoid` and those asked so lately that they would not answer, where there are
    /// others.
    pub(super) fn pick_sources(
        &mut self,
        stage: u32,
        avoid: Option<PeerKey>,
        now: Duration,
    ) -> Vec<PeerKey> {
        let mut replicas = self.members.vouched_replicas(stage);
        replicas.retain(|k| !self.role.is_source(*k));
        if replicas.len() > 1 {
            replicas.retain(|k| Some(*k) != avoid);
        }
        if replicas.iter().any(|k| !self.role.asked_lately(*k, now)) {
            replicas.retain(|k| !self.role.asked_lately(*k, now));
        }
        let most = if self.allreduce() {
            MAX_SOURCES
        } else {
            RACING_SOURCES
        };
        let mut picked = Vec::new();
        while picked.len() < most && !replicas.is_empty() {
            let i = (self.rng.next_u64() % replicas.len() as u64) as usize;
            picked.push(replicas.swap_remove(i));
        }
        picked
    }

    /// A sync's deadline passed: a download gives up the sources that made no progress and
    /// asks others if none is left; building a state that took too long starts again.
    pub(super) fn sync_overdue(&mut self, now: Duration) {
        let Some(stage) = self.role.stage() else {
            return;
        };
        if !self.role.downloading() {
            self.sync_from_someone(stage, None, now);
            return;
        }
        let timeout = self.timing.transfer_timeout;
        for k in self.role.expire_sources(now, timeout) {
            self.out.event(Event::Warning(format!(
                "state source {k} sent nothing for {timeout:?}: asking others"
            )));
        }
        self.more_sources(stage, now);
    }

    /// Sends what the download owes (chunk requests, releases), then asks more replicas for
    /// the state if no source of it is left (keeping the chunks held: a replica at the same
    /// step sends the same bytes); starts over if there is none to ask.
    pub(super) fn more_sources(&mut self, stage: u32, now: Duration) {
        self.send_download_messages();
        if self.role.live_sources() > 0 {
            return;
        }
        let sources = self.pick_sources(stage, None, now);
        if sources.is_empty() || sources.iter().all(|k| self.role.asked_lately(*k, now)) {
            self.sync_from_someone(stage, None, now);
            return;
        }
        let timeout = self.timing.transfer_timeout;
        for (k, m) in self.role.add_sources(&sources, now, timeout) {
            self.out.send(k, m);
        }
    }

    /// Sends the download's chunk requests and releases (see `Role::download_messages`).
    pub(super) fn send_download_messages(&mut self) {
        for (k, m) in self.role.download_messages() {
            self.out.send(k, m);
        }
    }

    pub(super) fn resync(&mut self, r: Resync, now: Duration) {
        let Some(stage) = self.role.stage() else {
            return;
        };
        self.out.event(Event::Resync {
            from: r.from,
            reason: r.reason,
        });
        if r.elsewhere || self.bans.is_banned(r.from) || self.role.asked_lately(r.from, now) {
            // It did not answer, or lied, or would not serve this peer again yet: another
            // replica's state.
            self.sync_from_someone(stage, Some(r.from), now);
            return;
        }
        // From the replica the vote found right, alone.
        self.start_sync(stage, &[r.from], now);
    }

    /// Drops everything in flight at this stage (it is about to be replaced): other drivers
    /// are told at once so they retry elsewhere; this peer's own microbatches are dropped.
    pub(super) fn abandon_stage_work(&mut self) {
        self.server.abandon(&mut self.out);
        self.out.jobs.drop_microbatch_work();
        self.steps.abandon(&mut self.out);
        self.out.jobs.forget_throughput();
        self.driver.abandon();
        // Held-out work of the old stage: its evaluators retry when their deadlines pass.
        self.evaluator.abandon();
        self.relays = Default::default();
        self.exports.forget_snapshots();
        // A new state may come with a new stage, whose next stage's replicas the old times
        // say nothing about (a re-sync at the same stage starts afresh too).
        self.service = Service::default();
        let bans = &self.bans;
        self.members.recheck(|k| (bans.verified(k), bans.worked(k)));
    }

    pub(super) fn on_chunk(&mut self, from: PeerKey, chunk: StateChunk, now: Duration) {
        match self.role.on_chunk(from, chunk, &self.timing, now) {
            ChunkOutcome::Pending => self.send_download_messages(),
            ChunkOutcome::Complete(done) => {
                self.send_download_messages();
                self.steps.set_position(done.step, done.round, true);
                if let Some(stage) = self.role.stage() {
                    self.out.event(Event::StateReceived {
                        stage,
                        bytes: done.bytes.len() as u64,
                        took: done.took,
                        senders: done.senders,
                    });
                    // The import replaces what the compute side holds, checked or not.
                    self.holds = None;
                    self.out.compute(Job::Import {
                        stage,
                        state: done.bytes,
                    });
                }
            }
            ChunkOutcome::Failed(e, culprits) => {
                self.out.event(Event::Warning(format!(
                    "state transfer from {culprits:?} failed: {e}"
                )));
                for k in culprits {
                    self.members.remove(k);
                }
                if let Some(stage) = self.role.stage() {
                    self.more_sources(stage, now);
                }
            }
        }
    }

    /// Where this replica's state stands, for the exports of `stage`.
    pub(super) fn state_at(&self, stage: u32) -> At {
        At {
            stage,
            step: self.steps.step(),
            round: self.steps.round(),
        }
    }

    pub(super) fn on_ready(&mut self, hash: u64, now: Duration) {
        let Some((stage, source)) = self.role.serve() else {
            return;
        };
        // In DiLoCo transferred parameters are mid-round (the source's local ones); only
        // hashes taken right after a round are comparable between replicas.
        let hash = self.allreduce().then_some(hash);
        // A state is checked against the parameters more than half of its stage announced
        // for its round, not taken on its sender's word: a state that differs is dropped and
        // another replica asked. (When its round is no longer among those kept, or not yet
        // announced, the hash vote after the next round does the same.)
        if let (Some(mine), Some(source)) = (hash, source)
            && agreement::majority_hash(&self.members, stage, self.steps.round(), |k| {
                self.members.is_checked(k)
            })
            .is_some_and(|h| h != mine)
        {
            self.out.event(Event::StateRefused { from: source });
            self.sync_from_someone(stage, Some(source), now);
            return;
        }
        self.holds = Some(stage);
        self.steps
            .start_serving(hash, source, now + self.timing.announce_every);
        self.release_held_forwards(now);
        self.out.event(Event::Serving {
            stage,
            step: self.steps.step(),
            from: source,
        });
        self.announce();
        self.next_announce = now + self.timing.announce_every;
    }
}
