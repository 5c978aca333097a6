//! What a run measured: the peers' events, recoveries, stage capacities and the report.

use super::*;

impl Sim {
    /// What peer `i`'s protocol event adds to the run's measurements.
    pub(super) fn on_event(&mut self, i: usize, e: Event) {
        if self.log_events {
            eprintln!("{:10.3} s  peer {i}: {e:?}", self.now_s());
        }
        let last = self.config.stages - 1;
        let stage = self.peers[i].machine.stage();
        if matches!(e, Event::Stepped { .. }) && !self.peers[i].attacker() {
            self.note_credits(i);
        }
        match e {
            // The run's loss and steps are the honest replicas': an attacker at the last stage
            // reports losses on its own targets (`label-flip`) or claims (`inflate`), and once
            // banned it steps alone.
            Event::Stepped { step, loss, .. }
                if stage == Some(last) && !self.peers[i].attacker() =>
            {
                // The run's step: the last stage's in allreduce mode; in DiLoCo, where each
                // replica steps on its own share, the global batches the stage has trained.
                let step = match self.config.sync {
                    SyncMode::AllReduce => step,
                    SyncMode::DiLoCo { .. } => {
                        let batch = (self.config.global_batch * self.config.seq) as u64;
                        (self.tokens / batch.max(1)).min(self.config.max_steps)
                    }
                };
                // One point per step in allreduce mode (the replicas agree); every replica's
                // local step in DiLoCo.
                let local = matches!(self.config.sync, SyncMode::DiLoCo { .. });
                let computed = self.setup.compute == Compute::Real;
                if let Some(l) = loss.filter(|_| computed && (local || step > self.step)) {
                    self.loss_curve
                        .push((self.now_s(), step.max(self.step), l as f64));
                }
                if step > self.step {
                    self.step = step;
                    self.tokens_curve.push((self.now_s(), self.tokens));
                }
                if self.slowest_at_first_step.is_none() {
                    self.slowest_at_first_step = Some(self.slowest_stage());
                }
                self.check_recoveries();
            }
            Event::Stepped { .. } => self.check_recoveries(),
            // Each evaluation when the first peer hears of it.
            Event::HeldOut(h)
                if self.setup.compute == Compute::Real
                    && self.val_curve.last().is_none_or(|v| v.1 < h.step) =>
            {
                self.val_curve
                    .push((self.now_s(), h.step, f64::from(h.loss)));
            }
            Event::Committed { sample } => {
                if let Some(s) = stage {
                    if !self.committed.insert((s, sample)) {
                        self.double_commits += 1;
                    }
                    if s == last {
                        self.tokens += (self.config.microbatch * self.config.seq) as u64;
                    }
                }
            }
            Event::Resync { .. } => self.resyncs += 1,
            Event::StateRefused { .. } => self.refused_states += 1,
            Event::RoundDegraded { refused, .. } if !self.peers[i].attacker() => {
                self.refused_parts += refused as u64;
            }
            Event::Violation { .. } => self.violations += 1,
            Event::Banned { peer, why, .. } if !self.peers[i].attacker() => {
                // The first honest peer to ban it; an attacker's bans are its own affair.
                if let Some(&j) = self.by_key.get(&peer)
                    && self.banned.iter().all(|b| b.1 != j)
                {
                    self.banned.push((self.now_s(), j, why.to_string()));
                }
            }
            Event::Discounted { peer, credit } if !self.peers[i].attacker() => {
                if let Some(&j) = self.by_key.get(&peer) {
                    let now = self.now_s();
                    let d = self.discounted.entry(j).or_insert((now, credit));
                    d.1 = d.1.min(credit);
                }
            }
            Event::Moving { from, to } => self.moves.push((self.now_s(), i, from, to)),
            Event::StateReceived {
                bytes,
                took,
                senders,
                ..
            } => {
                // Scaled-down tensors were charged their full size on the links.
                let bytes = bytes * self.peer_costs.param_scale as u64;
                let d = (self.now_s(), i, bytes, took.as_secs_f64(), senders);
                self.downloads.push(d);
            }
            Event::Warning(w) => {
                let known = self.warnings.len() < crate::report::MAX_WARNINGS;
                if known || self.warnings.contains_key(&w) {
                    self.warnings.entry(w).or_default().insert(i);
                }
            }
            Event::Serving { .. } if self.peers[i].served_at.is_none() => {
                self.peers[i].served_at = Some(self.now_s());
            }
            _ => {}
        }
    }

    /// The lowest weight factor honest peer `i` gives an honest stage-mate for its claims.
    fn note_credits(&mut self, i: usize) {
        for (member, credit) in self.peers[i].machine.claim_credits() {
            if let Some(&j) = self.by_key.get(member)
                && !self.peers[j].attacker()
            {
                self.honest_credit_min = self.honest_credit_min.min(*credit);
            }
        }
    }

    /// Every stage's honest replicas at its last round hold one parameter hash (a replica
    /// that has not averaged since it downloaded has none to compare).
    pub(super) fn honest_replicas_agree(&self) -> bool {
        let mut last: BTreeMap<u32, (u64, BTreeSet<u64>)> = BTreeMap::new();
        let honest = self
            .peers
            .iter()
            .filter(|p| p.alive() && !p.attacker() && p.machine.is_serving());
        for p in honest {
            let (Some(stage), Some(hash)) = (p.machine.stage(), p.machine.params_hash()) else {
                continue;
            };
            let round = p.machine.round();
            let entry = last.entry(stage).or_insert((round, BTreeSet::new()));
            if round > entry.0 {
                *entry = (round, BTreeSet::new());
            }
            if round == entry.0 {
                entry.1.insert(hash);
            }
        }
        last.values().all(|(_, hashes)| hashes.len() == 1)
    }

    pub(super) fn check_recoveries(&mut self) {
        let lowest = self.serving().map(|p| p.machine.step()).min().unwrap_or(0);
        let now = self.now_s();
        let (done, waiting): (Vec<Pending>, Vec<Pending>) =
            self.pending.drain(..).partition(|p| lowest >= p.step);
        self.pending = waiting;
        self.recoveries.extend(done.into_iter().map(|p| Recovery {
            cause: p.cause,
            at_s: p.at,
            seconds: Some(now - p.at),
        }));
    }

    /// Seconds `device` takes for the forward and backward pass of one microbatch at
    /// `stage`, per-job overheads included.
    pub(super) fn microbatch_seconds(&self, device: &DeviceProfile, stage: u32) -> f64 {
        let rows = self.config.microbatch;
        let forward = Job::Forward {
            id: 0,
            rows,
            sample: 0,
            input: Input::Tokens,
            held_out: false,
        };
        let backward = Job::Backward {
            id: 0,
            grad: None,
            rows,
        };
        let offload = self.offload.get(stage as usize);
        (device.job_time(&forward, Some(stage), &self.costs, offload)
            + device.job_time(&backward, Some(stage), &self.costs, offload))
        .as_secs_f64()
    }

    /// The least capacity of any stage, samples per second, over the replicas serving now.
    pub(super) fn slowest_stage(&self) -> f64 {
        let mut capacity = vec![0.0; self.config.stages as usize];
        for p in self.serving() {
            if let Some(c) = p.machine.stage().and_then(|s| capacity.get_mut(s as usize)) {
                let seconds = self.microbatch_seconds(&p.device, p.machine.stage().unwrap_or(0));
                *c += f64::from(self.config.microbatch) / seconds;
            }
        }
        capacity.into_iter().fold(f64::INFINITY, f64::min)
    }

    /// Tokens per second `device` trains alone: a microbatch's forward and backward pass
    /// through every stage, back to back, per-job overheads included.
    pub(super) fn compute_only_tokens_per_s(&self, device: &DeviceProfile) -> f64 {
        let seconds: f64 = (0..self.config.stages)
            .map(|stage| self.microbatch_seconds(device, stage))
            .sum();
        (self.config.microbatch * self.config.seq) as f64 / seconds
    }

    pub(super) fn report(mut self) -> Report {
        // The loop stops when the last replica takes the last step, or at `max_sim_s`.
        let finished = self.done();
        let end = self.now_s();
        let slowest_stage = (
            self.slowest_at_first_step.unwrap_or(0.0),
            self.slowest_stage(),
        );
        // Ideal: every peer busy with nothing but forward and backward passes, all the time
        // it was present, as if it ran every stage of the model itself.
        let token_seconds: f64 = self
            .peers
            .iter()
            .map(|p| self.compute_only_tokens_per_s(&p.device) * p.present(end))
            .sum();
        let ideal = if end > 0.0 { token_seconds / end } else { 0.0 };
        let present: f64 = self.peers.iter().map(|p| p.present(end)).sum();
        // Work given past the end (or past a crash) did not happen.
        let busy: f64 = self
            .peers
            .iter()
            .map(|p| (p.busy_total - (p.busy_until - p.left(end)).max(0.0)).max(0.0))
            .sum();
        let achieved = if end > 0.0 {
            self.tokens as f64 / end
        } else {
            0.0
        };
        let (mut dropped, mut retried, mut discarded) = (0, 0, 0);
        let alive = self.peers.iter().filter(|p| p.alive());
        for s in alive
            .map(|p| p.machine.stats())
            .chain(self.gone_stats.clone())
        {
            dropped += s.microbatches_dropped;
            retried += s.microbatches_retried;
            discarded += s.gradients_discarded;
        }
        let tail = &self.loss_curve[self.loss_curve.len().saturating_sub(5)..];
        let final_loss =
            (!tail.is_empty()).then(|| tail.iter().map(|p| p.2).sum::<f64>() / tail.len() as f64);
        self.recoveries
            .extend(self.pending.drain(..).map(|p| Recovery {
                cause: p.cause,
                at_s: p.at,
                seconds: None,
            }));
        let honest = || {
            self.peers
                .iter()
                .filter(|p| p.alive() && !p.attacker() && p.machine.is_serving())
        };
        let nonfinite_replicas = honest().filter(|p| p.holds_nonfinite()).count();
        let honest_agree = self.honest_replicas_agree();
        let attackers = (0..self.peers.len())
            .filter(|i| self.peers[*i].attacker())
            .collect();
        let false_bans = self
            .banned
            .iter()
            .filter(|b| !self.peers[b.1].attacker())
            .count();
        let discounted: Vec<(f64, usize, f64)> = self
            .discounted
            .iter()
            .map(|(&j, &(at, credit))| (at, j, credit))
            .collect();
        let false_discounts = discounted
            .iter()
            .filter(|d| !self.peers[d.1].attacker())
            .count();
        // Late joiners: those not there from the start, which must download a state.
        let joins = (0..self.peers.len())
            .filter(|i| self.peers[*i].joined_at > 0.0 && !self.peers[*i].sybil)
            .map(|i| {
                let p = &self.peers[i];
                (p.joined_at, i, p.served_at.map(|t| t - p.joined_at))
            })
            .collect();
        Report {
            seed: 0,
            peers: self.peers.len(),
            sim_seconds: end,
            ideal_tokens_per_s: ideal,
            achieved_tokens_per_s: achieved,
            efficiency: if ideal > 0.0 { achieved / ideal } else { 0.0 },
            device_busy: if present > 0.0 { busy / present } else { 0.0 },
            steps: self.step,
            finished,
            compute: self.setup.compute.name().into(),
            final_loss,
            loss_curve: self.loss_curve,
            val_curve: self.val_curve,
            tokens_curve: self.tokens_curve,
            stage_busy_seconds: self.stage_busy,
            bytes: Traffic::ALL
                .iter()
                .map(|t| {
                    (
                        t.name().to_string(),
                        self.bytes.get(t).copied().unwrap_or(0),
                    )
                })
                .chain([("gossip".to_string(), self.gossip_bytes)])
                .collect(),
            boundary_codecs: self.boundary_codecs,
            tokens: self.tokens,
            microbatches_dropped: dropped,
            microbatches_retried: retried,
            gradients_discarded: discarded,
            double_commits: self.double_commits,
            resyncs: self.resyncs,
            refused_states: self.refused_states,
            refused_parts: self.refused_parts,
            violations: self.violations,
            attackers,
            banned: self.banned,
            false_bans,
            discounted,
            false_discounts,
            honest_credit_min: self.honest_credit_min,
            nonfinite_replicas,
            honest_agree,
            recoveries: self.recoveries,
            moves: self.moves,
            downloads: self.downloads,
            joins,
            warnings: {
                let mut w: Vec<(String, usize)> = self
                    .warnings
                    .into_iter()
                    .map(|(k, p)| (k, p.len()))
                    .collect();
                w.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                w
            },
            slowest_stage,
            events: self.events,
            event_hash: format!("{:016x}", self.trace.digest()),
        }
    }
}
