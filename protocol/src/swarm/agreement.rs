//! How a replica gets back to the parameters its stage's other replicas hold.
//!
//! A replica a round behind replays the round it missed from another replica's record of it
//! (a catch-up: the round's averaged parts as their owners encoded them, so it costs what the
//! round's parts did and lands on bit-identical parameters); if the record is gone, or
//! no answer comes, it downloads the stage's state instead. Replicas at the same round whose
//! parameters differ settle it by a vote over the hashes they announce: the side fewer
//! replicas hold downloads the other's state.

use super::PeerKey;
use super::averaging::part_range;
use super::membership::{Member, Membership};
use super::message::Message;
use super::norms;
use super::outbox::Outbox;
use super::server::decode;
use crate::{Codec, Encoder};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of round results kept for replicas that fall behind (at least the last round is
/// kept whatever its size).
const HISTORY_BYTES: usize = 64 << 20;

/// This replica should download its stage's state again, from `from` (or, when `from` did not
/// answer or lied, from another replica).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Resync {
    /// The replica to download from, or to avoid.
    pub from: PeerKey,
    /// Why.
    pub reason: &'static str,
    /// Download from another replica than `from`.
    pub elsewhere: bool,
}

/// One round's result as kept: each part's encoding, whose decodings make up the vector
/// every replica applied.
#[derive(Debug)]
struct Record {
    round: u64,
    parts: Vec<Arc<Vec<u8>>>,
    samples: f64,
    /// Root mean square of the applied vector (how large a round's result is).
    rms: f64,
}

impl Record {
    fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }
}

/// The results of recent rounds, to replay for a replica that missed them.
#[derive(Debug, Default)]
struct RoundHistory {
    rounds: VecDeque<Record>,
    /// Rounds from this one on are kept beyond [`HISTORY_BYTES`], up to the bytes given: a
    /// state being downloaded from this replica is that old, and its downloader will ask
    /// for them.
    keep: Option<(u64, usize)>,
}

impl RoundHistory {
    /// The median root-mean-square of the rounds kept that had samples (0 when none is). A
    /// round without samples says nothing of a round's size: a replica whose stage-mates had
    /// no microbatches (the other side of a partition held the pipeline) applies a run of them,
    /// and judged by those it took an honest catch-up for a lie.
    fn median_rms(&self) -> f64 {
        let mut sizes: Vec<f64> = self
            .rounds
            .iter()
            .filter(|r| r.samples > 0.0)
            .map(|r| r.rms)
            .collect();
        sizes.sort_by(f64::total_cmp);
        sizes.get(sizes.len() / 2).copied().unwrap_or(0.0)
    }

    /// Keeps `record`, forgetting the oldest beyond [`HISTORY_BYTES`] (or the retention asked
    /// for, see [`CatchUp::keep_since`]).
    fn remember(&mut self, record: Record) {
        self.rounds.retain(|r| r.round != record.round);
        self.rounds.push_back(record);
        self.trim();
    }

    fn trim(&mut self) {
        let mut bytes: usize = self.rounds.iter().map(Record::bytes).sum();
        while self.rounds.len() > 1 {
            let oldest = self.rounds[0].round;
            let budget = match self.keep {
                Some((since, budget)) if oldest >= since => budget.max(HISTORY_BYTES),
                _ => HISTORY_BYTES,
            };
            if bytes <= budget {
                break;
            }
            if let Some(old) = self.rounds.pop_front() {
                bytes -= old.bytes();
            }
        }
    }

    fn get(&self, round: u64) -> Option<&Record> {
        self.rounds.iter().find(|h| h.round == round)
    }
}

/// A catch-up's parts in one buffer: each part's encoded tensor after its length (u32,
/// little-endian).
pub fn frame_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// The parts of a catch-up framed by [`frame_parts`]; None if the framing does not hold or
/// it has more parts than a round can have (one per member, at most
/// [`MAX_MEMBERS`](super::membership::MAX_MEMBERS)): the list allocated follows that bound,
/// not the message's size.
pub fn parts_of(data: &[u8]) -> Option<Vec<&[u8]>> {
    let mut parts = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if parts.len() == super::membership::MAX_MEMBERS {
            return None;
        }
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let part = rest.get(4..4usize.checked_add(len)?)?;
        parts.push(part);
        rest = &rest[4 + len..];
    }
    Some(parts)
}

/// A catch-up request on its way.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Asked {
    from: PeerKey,
    round: u64,
    deadline: Duration,
}

/// Catch-ups: asking for missed rounds, and answering others' requests from the record.
#[derive(Debug, Default)]
pub(super) struct CatchUp {
    history: RoundHistory,
    asked: Option<Asked>,
    /// The last round answered to each replica that asked: a round is answered once per
    /// replica (encoding it copies a parameter-sized vector).
    answered: BTreeMap<PeerKey, u64>,
    encoder: Encoder,
}

impl CatchUp {
    /// Records the result of `round`, for replicas that miss it: the applied vector `values`
    /// and each part's encoding where it has one (`parts`, one per part; a part without one
    /// is kept in fp32).
    pub fn remember(
        &mut self,
        round: u64,
        values: &[f32],
        parts: &[Option<Arc<Vec<u8>>>],
        samples: f64,
    ) {
        let n = parts.len().max(1);
        let parts = (0..n)
            .map(|j| match parts.get(j).cloned().flatten() {
                Some(bytes) => bytes,
                None => Arc::new(self.exact(&values[part_range(values.len(), n, j)])),
            })
            .collect();
        self.history.remember(Record {
            round,
            parts,
            samples,
            rms: norms::rms(values),
        });
    }

    /// An encoding of `part` that decodes to exactly its values: int8 where it does (a part
    /// nobody delivered is applied as zeros, which int8 holds exactly), else fp32.
    fn exact(&mut self, part: &[f32]) -> Vec<u8> {
        let mut data = Vec::new();
        let compact = Codec::Int8 {
            block: crate::codec::DEFAULT_INT8_BLOCK,
        };
        let encoded = self.encoder.encode(compact, part, &[part.len()], &mut data);
        if encoded.is_ok()
            && decode(&data, part.len())
                .is_some_and(|v| v.iter().zip(part).all(|(a, b)| a.to_bits() == b.to_bits()))
        {
            return data;
        }
        data.clear();
        // fp32 of finite values cannot fail; an empty record answers nothing.
        let _ = self
            .encoder
            .encode(Codec::Fp32, part, &[part.len()], &mut data);
        data
    }

    /// Keeps the rounds from `round` on, up to `bytes` of them (None: the usual
    /// [`HISTORY_BYTES`]): a replica serving a download of its state at `round` keeps what
    /// its downloader will need to catch up instead of downloading again.
    pub fn keep_since(&mut self, keep: Option<(u64, usize)>) {
        self.history.keep = keep;
        self.history.trim();
    }

    /// Whether a request is on its way.
    pub fn asking(&self) -> bool {
        self.asked.is_some()
    }

    /// When an unanswered request is given up.
    pub fn deadline(&self) -> Option<Duration> {
        self.asked.map(|a| a.deadline)
    }

    /// Asks `from` for the result of `round` of `stage`, to come by `deadline`.
    pub fn ask(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        stage: u32,
        round: u64,
        deadline: Duration,
    ) {
        self.asked = Some(Asked {
            from,
            round,
            deadline,
        });
        out.send(from, Message::CatchUpRequest { stage, round });
    }

    /// Another replica asks for the result of `round`: each part as its owner encoded it (the
    /// replica that decodes them lands on bit-identical parameters, and the answer costs what
    /// the round's averaged parts did, not fp32), or nothing if it is no longer kept.
    pub fn answer(&mut self, out: &mut Outbox, to: PeerKey, stage: u32, round: u64) {
        if self.answered.get(&to).is_some_and(|r| round <= *r) {
            return;
        }
        self.answered.insert(to, round);
        let (samples, data) = match self.history.get(round) {
            Some(r) => (r.samples, frame_parts(r.parts.iter().map(|p| p.as_slice()))),
            None => (0.0, Vec::new()),
        };
        out.send(
            to,
            Message::CatchUp {
                stage,
                round,
                samples,
                data,
            },
        );
    }

    /// An answer from `from` about `round`, carrying `len` values behind `samples`. None if
    /// it was not asked for (it is ignored); otherwise the values to apply, or, for an empty
    /// or malformed answer, a download from that replica.
    pub fn on_answer(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        round: u64,
        samples: f64,
        data: &[u8],
        len: usize,
    ) -> Option<Result<Vec<f32>, Resync>> {
        if self.asked.map(|a| (a.from, a.round)) != Some((from, round)) {
            return None;
        }
        self.asked = None;
        let download = Resync {
            from,
            reason: "a replica of this stage is ahead",
            elsewhere: false,
        };
        if data.is_empty() {
            // Its record no longer holds the round: an honest answer.
            return Some(Err(download));
        }
        let lied = Resync {
            reason: "a replica answered a catch-up request with values no honest one sends",
            elsewhere: true,
            ..download
        };
        let decoded = parts_of(data)
            .filter(|parts| !parts.is_empty() && parts.len() <= len.max(1) && samples.is_finite())
            .and_then(|parts| {
                let n = parts.len();
                let mut values = Vec::with_capacity(len);
                for (j, p) in parts.iter().enumerate() {
                    let want = part_range(len, n, j).len();
                    values.extend(decode(p, want).filter(|v| v.len() == want)?);
                }
                Some((parts, values))
            });
        let Some((parts, values)) = decoded else {
            out.violation(
                from,
                "a catch-up malformed, of the wrong size or not finite",
            );
            return Some(Err(lied));
        };
        // The rounds this replica applied itself say how large a round's result is: the
        // median of those kept, as one round can be near zero (its contributions left out
        // or zeroed), and would make any honest round look absurd.
        let expected = self.history.median_rms();
        let rms = norms::rms(&values);
        if !norms::within(rms, expected) {
            out.violation(from, "a catch-up far larger than the rounds before it");
            return Some(Err(lied));
        }
        // Kept as it came, to answer others in turn.
        self.history.remember(Record {
            round,
            parts: parts.iter().map(|p| Arc::new(p.to_vec())).collect(),
            samples,
            rms,
        });
        Some(Ok(values))
    }

    /// A request that got no answer by its deadline: download the state instead.
    pub fn expire(&mut self, now: Duration) -> Option<Resync> {
        let a = self.asked.filter(|a| now >= a.deadline)?;
        self.asked = None;
        Some(Resync {
            from: a.from,
            reason: "no answer to a catch-up request",
            elsewhere: true,
        })
    }

    /// Forgets the record and any request: they were about a stage no longer served.
    pub fn abandon(&mut self) {
        self.asked = None;
        self.history.rounds.clear();
        self.answered.clear();
    }
}

/// The parameter hash more than half of the serving replicas of `stage` announced for
/// `round` (their latest rounds are kept, see [`Member::hash_at`]), if there is one. Only
/// the replicas whose work this peer checked vote (see [`super::bans::Bans::verified`]),
/// unless it checked none of them: a peer that joins the stage has seen no work yet and can
/// only count announcements.
pub(super) fn majority_hash(
    members: &Membership,
    stage: u32,
    round: u64,
    verified: impl Fn(PeerKey) -> bool,
) -> Option<u64> {
    let serving: Vec<(PeerKey, &Member)> = members
        .iter()
        .filter(|(_, m)| m.serves(stage))
        .map(|(k, m)| (*k, m))
        .collect();
    let checked = serving.iter().any(|(k, _)| verified(*k));
    let mut voters = 0;
    let mut votes: Vec<(u64, usize)> = Vec::new();
    for (_, m) in serving.iter().filter(|(k, _)| !checked || verified(*k)) {
        voters += 1;
        if let Some(h) = m.hash_at(round) {
            match votes.iter_mut().find(|(v, _)| *v == h) {
                Some((_, n)) => *n += 1,
                None => votes.push((h, 1)),
            }
        }
    }
    votes
        .into_iter()
        .find(|(_, n)| 2 * n > voters)
        .map(|(h, _)| h)
}

/// The hash vote, seen from a replica at `round` of `stage` whose parameters hash to `mine`
/// when `from` announced `theirs` for the same round: this replica loses if more serving
/// replicas announced the other's hash for this round than its own (itself counted; what they
/// announced for it counts after they moved on, see [`Member::hash_at`]) and those still at an
/// earlier round together (the first announcements to arrive may be a colluding minority's,
/// sent at once: two attackers agreeing on a forged hash had outvoted the last replica to
/// finish a run while the others' announcements of the last round were on their way), or as
/// many, every serving replica of the stage has announced this round (no vote is still to
/// come) and the other side has more replicas among all that announced the round (checked or
/// not), or as many and the smaller key. The loser downloads the winner's state. Without the
/// wait for every vote in a tie, the first announcement of a round to arrive would win a tie
/// of one against one, however many replicas were still to announce the majority's hash.
/// Only the replicas `verified` admits vote: those whose work this replica checked
/// (identities that only announce a hash cannot outvote it however many they are), or every
/// one while it checked none (a replica restarted from its checkpoint has nothing else to go
/// by; without that, two replicas that had not checked each other would each keep their own
/// parameters).
/// Unchecked replicas break a tie of checked ones: a replica that checked one of two others
/// holding the same parameters, and not the other, would otherwise win its tie against the
/// one it checked by key, and keep the parameters only it holds to the end of the run (those
/// two count each other and it); a tie of checked replicas is one that a ground key already
/// decides, so identities that only announce decide nothing they could not otherwise.
#[allow(clippy::too_many_arguments)]
pub(super) fn outvoted(
    members: &Membership,
    me: PeerKey,
    stage: u32,
    round: u64,
    from: PeerKey,
    theirs: u64,
    mine: u64,
    verified: impl Fn(PeerKey) -> bool,
) -> bool {
    // Checked replicas yet to announce the round, and past it with no hash of it known.
    let (mut for_theirs, mut for_mine, mut to_come, mut unknown) = (0, 1, 0, 0);
    // Every serving replica's announcement, checked or not: only for a tie of checked ones.
    let (mut all_theirs, mut all_mine) = (0, 1);
    for k in members.serving_in(stage) {
        let Some(m) = members.get(k) else {
            continue;
        };
        let hash = m.hash_at(round);
        all_theirs += usize::from(hash == Some(theirs));
        all_mine += usize::from(hash == Some(mine));
        if !verified(k) {
            continue;
        }
        match hash {
            None if m.announcement.round < round => to_come += 1,
            None => unknown += 1,
            Some(h) if h == theirs => for_theirs += 1,
            Some(h) if h == mine => for_mine += 1,
            Some(_) => {}
        }
    }
    for_theirs > for_mine + to_come
        || (for_theirs == for_mine
            && to_come + unknown == 0
            && (all_theirs > all_mine || (all_theirs == all_mine && from < me)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::{self, at_round};
    use crate::swarm::interface::{Action, Event};
    use crate::swarm::message::Announcement;

    const MS: Duration = Duration::from_millis(1);

    /// `n` values int8 cannot hold exactly: a round kept in fp32.
    fn plain(n: usize) -> Vec<f32> {
        (0..n).map(|i| 1.0 + (i % 97) as f32 * 1e-6).collect()
    }
    const ME: PeerKey = PeerKey(5);

    /// What replica 9, holding `theirs`, answers this replica's catch-up request for `round`
    /// of stage 1: the round's samples and its encoded vector.
    fn answer_to_me(theirs: &mut CatchUp, round: u64) -> (f64, Vec<u8>) {
        let mut out = Outbox::new(PeerKey(9));
        theirs.answer(&mut out, ME, 1, round);
        let Some(Action::Send {
            msg: Message::CatchUp { samples, data, .. },
            ..
        }) = out.pop()
        else {
            panic!("an answer");
        };
        (samples, data)
    }
    const ALL: fn(PeerKey) -> bool = |_| true;

    fn members(list: &[(u64, u32, u64, u64)]) -> Membership {
        fixtures::members(
            list.iter()
                .map(|&(k, s, r, h)| (k, at_round(s, r, Some(h)))),
        )
    }

    #[test]
    fn rounds_since_a_held_snapshot_are_kept_beyond_the_usual_budget() {
        let big = plain(HISTORY_BYTES / 4 / 2 + 1);
        let mut c = CatchUp::default();
        for r in 0..4 {
            c.remember(r, &big, &[None], 1.0);
        }
        assert_eq!(
            c.history.rounds.len(),
            1,
            "the usual budget holds one such round"
        );
        c.keep_since(Some((4, 4 * HISTORY_BYTES)));
        for r in 4..8 {
            c.remember(r, &big, &[None], 1.0);
        }
        assert_eq!(c.history.rounds.len(), 4, "a downloader's rounds are kept");
        assert!(c.history.get(4).is_some());
        c.keep_since(None);
        assert_eq!(c.history.rounds.len(), 1);
    }

    #[test]
    fn a_missed_round_is_replayed_from_the_record_of_the_replica_asked() {
        let mut mine = CatchUp::default();
        let mut out = Outbox::new(ME);
        mine.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        assert!(mine.asking());
        assert_eq!(
            out.drain(),
            [Action::Send {
                to: PeerKey(9),
                msg: Message::CatchUpRequest { stage: 1, round: 4 }
            }]
        );
        let mut theirs = CatchUp::default();
        theirs.remember(4, &[0.25; 3], &[None], 8.0);
        let (samples, data) = answer_to_me(&mut theirs, 4);
        // Not from the replica asked, or about another round: ignored.
        assert_eq!(
            mine.on_answer(&mut out, PeerKey(8), 4, samples, &data, 3),
            None
        );
        assert_eq!(
            mine.on_answer(&mut out, PeerKey(9), 3, samples, &data, 3),
            None
        );
        assert_eq!(
            mine.on_answer(&mut out, PeerKey(9), 4, samples, &data, 3),
            Some(Ok(vec![0.25; 3]))
        );
        assert!(!mine.asking());
        assert_eq!(
            mine.on_answer(&mut out, PeerKey(9), 4, samples, &data, 3),
            None,
            "once"
        );
        // A round is answered once per replica: asking again costs the other side nothing.
        let mut their_out = Outbox::new(PeerKey(9));
        theirs.answer(&mut their_out, ME, 1, 4);
        theirs.answer(&mut their_out, ME, 1, 3);
        assert_eq!(their_out.pop(), None);
    }

    #[test]
    fn a_catch_up_that_cannot_work_ends_in_a_download() {
        let mut c = CatchUp::default();
        let mut out = Outbox::new(ME);
        // The record is gone: the answer is empty.
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        let empty = c.on_answer(&mut out, PeerKey(9), 4, 0.0, &[], 3);
        assert_eq!(empty.map(|r| r.map_err(|e| e.from)), Some(Err(PeerKey(9))));
        // The wrong size.
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        let two = crate::codec::encode_to_vec(Codec::Fp32, &[1.0; 2], &[2]).unwrap();
        let two = frame_parts([two.as_slice()]);
        assert!(matches!(
            c.on_answer(&mut out, PeerKey(9), 4, 1.0, &two, 3),
            Some(Err(_))
        ));
        // Regression: a NaN in the answer was applied as a step, turning the stage's
        // parameters into NaN everywhere it spread.
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        let nan = fixtures::poisoned(3);
        let nan = frame_parts([nan.as_slice()]);
        assert!(matches!(
            c.on_answer(&mut out, PeerKey(9), 4, 1.0, &nan, 3),
            Some(Err(_))
        ));
        // More parts than a round has members: refused before they are listed.
        assert!(parts_of(&[0u8; 4 * (super::super::membership::MAX_MEMBERS + 1)]).is_none());
        assert!(parts_of(&[0u8; 4 * super::super::membership::MAX_MEMBERS]).is_some());
        // Framing that does not hold.
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        assert!(matches!(
            c.on_answer(&mut out, PeerKey(9), 4, 1.0, &[9, 0, 0, 0, 1], 3),
            Some(Err(_))
        ));
        assert_eq!(
            out.violations, 3,
            "the wrong size, the NaN and the framing, not the empty record"
        );
        // Finite, but a million times larger than the rounds this replica applied itself.
        c.remember(3, &[0.5; 3], &[None], 8.0);
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        let huge = crate::codec::encode_to_vec(Codec::Fp32, &[5e5; 3], &[3]).unwrap();
        let huge = frame_parts([huge.as_slice()]);
        assert!(matches!(
            c.on_answer(&mut out, PeerKey(9), 4, 1.0, &huge, 3),
            Some(Err(_))
        ));
        assert_eq!(out.violations, 4);
        // No answer by the deadline.
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        assert_eq!(c.deadline(), Some(300 * MS));
        assert_eq!(c.expire(299 * MS), None);
        assert_eq!(c.expire(300 * MS).map(|r| r.from), Some(PeerKey(9)));
        assert!(!c.asking());
    }

    /// Regression: after a partition healed, a replica whose last round was all but zero
    /// (its contributions left out) took an honest catch-up for an absurd one, and accused
    /// its sender. What a round is expected to weigh is the median of the rounds kept.
    #[test]
    fn one_round_near_zero_does_not_make_honest_catch_ups_look_absurd() {
        let mut c = CatchUp::default();
        let mut out = Outbox::new(ME);
        for round in 0..3 {
            c.remember(round, &[0.5; 3], &[None], 8.0);
        }
        c.remember(3, &[1e-9; 3], &[None], 8.0);
        c.ask(&mut out, PeerKey(9), 1, 4, 300 * MS);
        let honest = crate::codec::encode_to_vec(Codec::Fp32, &[0.4; 3], &[3]).unwrap();
        let honest = frame_parts([honest.as_slice()]);
        assert_eq!(
            c.on_answer(&mut out, PeerKey(9), 4, 1.0, &honest, 3),
            Some(Ok(vec![0.4; 3]))
        );
        assert_eq!(out.violations, 0);
    }

    #[test]
    fn the_record_keeps_the_latest_rounds_within_its_budget() {
        let mut c = CatchUp::default();
        let big = plain(HISTORY_BYTES / 4 / 2 + 1);
        c.remember(0, &big, &[None], 1.0);
        c.remember(1, &big, &[None], 1.0);
        assert!(c.history.get(0).is_none());
        assert!(c.history.get(1).is_some());
        let huge = plain(HISTORY_BYTES / 4 + 1);
        c.remember(2, &huge, &[None], 1.0);
        assert!(
            c.history.get(2).is_some(),
            "the last round is kept whatever its size"
        );
    }

    /// A round is kept and replayed as its owners encoded its parts: a catch-up costs what
    /// the round's parts did (int8 here, a quarter of fp32), and decodes to exactly the
    /// vector the replicas applied.
    #[test]
    fn a_catch_up_carries_the_parts_as_encoded_and_decodes_to_what_was_applied() {
        let values: Vec<f32> = (0..4000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        let int8 = Codec::Int8 { block: 64 };
        let n = 3;
        let mut applied = Vec::new();
        let mut parts = Vec::new();
        for j in 0..n {
            let part = &values[part_range(values.len(), n, j)];
            let bytes = crate::codec::encode_to_vec(int8, part, &[part.len()]).unwrap();
            applied.extend(decode(&bytes, part.len()).unwrap());
            parts.push(Some(Arc::new(bytes)));
        }
        // The middle part was refused: applied as zeros, kept in int8 (zeros are exact).
        let middle = part_range(values.len(), n, 1);
        applied[middle.clone()].iter_mut().for_each(|v| *v = 0.0);
        parts[1] = None;
        let mut theirs = CatchUp::default();
        theirs.remember(7, &applied, &parts, 16.0);
        let (samples, data) = answer_to_me(&mut theirs, 7);
        let fp32 = 4 * values.len();
        assert!(
            data.len() < fp32 / 4 + 4 * middle.len() + 200,
            "{} bytes",
            data.len()
        );
        let mut mine = CatchUp::default();
        let mut out = Outbox::new(ME);
        mine.ask(&mut out, PeerKey(9), 1, 7, 300 * MS);
        let got = mine.on_answer(&mut out, PeerKey(9), 7, samples, &data, values.len());
        assert_eq!(got, Some(Ok(applied)));
        // Kept as it came: this replica answers the round in turn, byte for byte.
        let mut again = Outbox::new(ME);
        mine.answer(&mut again, PeerKey(3), 1, 7);
        let Some(Action::Send {
            msg: Message::CatchUp { data: relayed, .. },
            ..
        }) = again.pop()
        else {
            panic!("an answer");
        };
        assert_eq!(relayed, data);
    }

    /// A catch-up is judged against the size of the rounds this replica applied that had
    /// samples: rounds without any (its stage-mates had no microbatches while the pipeline
    /// was on the other side of a partition) are near zero and would make an honest round
    /// look a thousand times too large.
    #[test]
    fn rounds_without_samples_do_not_set_the_size_a_catch_up_is_judged_by() {
        let round = |scale: f32| -> Vec<f32> { (0..600).map(|i| (i % 7) as f32 * scale).collect() };
        let mut theirs = CatchUp::default();
        theirs.remember(9, &round(1e-2), &[None], 32.0);
        let (samples, data) = answer_to_me(&mut theirs, 9);
        let mut mine = CatchUp::default();
        mine.remember(5, &round(1e-2), &[None], 32.0);
        for r in 6..9 {
            mine.remember(r, &round(1e-7), &[None], 0.0);
        }
        let mut out = Outbox::new(ME);
        mine.ask(&mut out, PeerKey(9), 1, 9, 300 * MS);
        let got = mine.on_answer(&mut out, PeerKey(9), 9, samples, &data, 600);
        assert_eq!(got, Some(Ok(round(1e-2))));
        assert!(
            !std::iter::from_fn(|| out.pop())
                .any(|a| matches!(a, Action::Event(Event::Violation { .. }))),
            "an honest catch-up taken for a lie"
        );
    }

    /// The hash vote: the side with fewer replicas at the round downloads the other's state;
    /// a tie goes to the smaller key once no replica of the stage is still to announce the
    /// round; replicas of other stages or rounds do not vote.
    #[test]
    fn the_side_fewer_replicas_hold_downloads_the_state() {
        let vote = |m: &Membership, from: u64| outvoted(m, ME, 1, 0, PeerKey(from), 3, 7, ALL);
        assert!(vote(&members(&[(3, 1, 0, 3)]), 3), "tie, smaller key");
        assert!(!vote(&members(&[(9, 1, 0, 3)]), 9), "tie, larger key");
        assert!(
            vote(&members(&[(9, 1, 0, 3), (8, 1, 0, 3)]), 9),
            "two to one"
        );
        let majority = members(&[(9, 1, 0, 3), (8, 1, 0, 7), (6, 1, 0, 7)]);
        assert!(!vote(&majority, 9), "one to three");
        let elsewhere = members(&[(9, 1, 0, 3), (8, 1, 0, 3), (6, 2, 0, 3), (4, 1, 1, 3)]);
        assert!(vote(&elsewhere, 9));
        let only_others = members(&[(9, 1, 0, 3), (6, 2, 0, 3), (4, 1, 1, 3)]);
        assert!(!vote(&only_others, 9));
        // The first announcement of a round to arrive does not win a tie while others of
        // the stage are still at an earlier round.
        let early = members(&[(3, 1, 1, 3), (8, 1, 0, 7), (6, 1, 0, 7)]);
        let vote_at = |m: &Membership, round| outvoted(m, ME, 1, round, PeerKey(3), 3, 7, ALL);
        assert!(!vote_at(&early, 1), "one to one, two still to announce");
        // Nor does a minority that announces first (two colluders that agree on a forged
        // hash and announce it before the others): the side that wins must be more than this
        // one's and every vote still to come.
        let first = members(&[(9, 1, 1, 3), (8, 1, 1, 3), (6, 1, 0, 7), (5, 1, 0, 7)]);
        assert!(!vote_at(&first, 1), "two to one, two still to announce");
        let decided = members(&[(9, 1, 1, 3), (8, 1, 1, 3), (6, 1, 1, 3), (5, 1, 0, 7)]);
        assert!(vote_at(&decided, 1), "three to one, one still to announce");
        let settled = members(&[(3, 1, 0, 3), (8, 1, 0, 7), (6, 1, 0, 3)]);
        assert!(
            vote_at(&settled, 0),
            "two to two, all announced, smaller key"
        );
    }

    /// A replica that diverged is re-synced against every attacker of its stage, whether
    /// they announce its hash or keep announcing an earlier round, as long as more than half
    /// of the stage agree: the majority then outnumbers it and them together. At half it can
    /// be kept apart (the README's threat model says so).
    #[test]
    fn more_than_half_in_agreement_re_sync_a_replica_that_diverged() {
        let vote = |m: &Membership| outvoted(m, ME, 1, 1, PeerKey(9), 3, 7, ALL);
        // Attackers: 4 announces this replica's hash, 2 stays a round behind.
        let attackers = [(4, 1, 1, 7), (2, 1, 0, 7)];
        let stage = |honest: &[u64]| {
            let mut list: Vec<_> = honest.iter().map(|&k| (k, 1, 1, 3)).collect();
            list.extend(attackers);
            members(&list)
        };
        assert!(vote(&stage(&[9, 8, 7, 6])), "4 of 7 agree");
        assert!(!vote(&stage(&[9, 8, 6])), "3 of 6 agree");
    }

    /// Identities that announce a hash but did no work this replica checked (sybils) do not
    /// vote, however many; a replica that checked no one's work (it is joining) counts
    /// every announcement, as it has nothing else to go by.
    #[test]
    fn only_replicas_whose_work_was_checked_vote() {
        let mut list = vec![(8, 1, 0, 7), (6, 1, 0, 7), (4, 1, 0, 7)];
        list.extend((100..110).map(|k| (k, 1, 0, 3)));
        let m = members(&list);
        let checked = |k: PeerKey| k.0 < 10;
        assert!(!outvoted(&m, ME, 1, 0, PeerKey(100), 3, 7, checked));
        assert!(outvoted(&m, ME, 1, 0, PeerKey(100), 3, 7, ALL));
        assert_eq!(majority_hash(&m, 1, 0, checked), Some(7));
        assert_eq!(majority_hash(&m, 1, 0, |_| false), Some(3));
        assert_eq!(majority_hash(&m, 1, 0, |k| k.0 == 8), Some(7));
    }

    /// Three replicas end a round apart, one against two, and the one alone checked only
    /// one of the others: the checked replicas tie, and the third (unchecked) decides it, not
    /// the smaller key, or the run would end with the stage apart. Unchecked identities
    /// decide nothing more: not against a majority of checked replicas.
    #[test]
    fn unchecked_replicas_break_a_tie_of_checked_ones() {
        let m = members(&[(8, 1, 0, 3), (9, 1, 0, 3)]);
        let checked = |k: PeerKey| k.0 == 8;
        assert!(ME < PeerKey(8));
        assert!(outvoted(&m, ME, 1, 0, PeerKey(8), 3, 7, checked));
        // Seen from replica 8, which checked both: two against one.
        let m8 = members(&[(5, 1, 0, 7), (9, 1, 0, 3)]);
        assert!(!outvoted(&m8, PeerKey(8), 1, 0, ME, 7, 3, ALL));
        // Ten identities that only announce cannot outvote two checked replicas.
        let mut list = vec![(8, 1, 0, 3), (6, 1, 0, 7)];
        list.extend((100..110).map(|k| (k, 1, 0, 3)));
        let m = members(&list);
        let checked = |k: PeerKey| k.0 < 10;
        assert!(!outvoted(&m, ME, 1, 0, PeerKey(8), 3, 7, checked));
    }

    /// Replicas announce every round, and a state often arrives after its stage has moved
    /// on: it is checked against what the replicas announced for its round, as long as that
    /// is among the rounds kept. A restart (an older round, or a new incarnation) starts the
    /// record afresh.
    #[test]
    fn the_majority_of_a_round_the_stage_has_left_behind_is_remembered() {
        let announce = |m: &mut Membership, k: u64, round: u64, incarnation: u64, h: u64| {
            let a = Announcement {
                seq: round,
                incarnation,
                ..at_round(1, round, Some(h * 1000 + round))
            };
            m.update(PeerKey(k), a, Duration::ZERO);
        };
        let mut m = Membership::default();
        for round in 0..40 {
            for (k, h) in [(8, 7), (6, 7), (4, 3)] {
                announce(&mut m, k, round, 1, h);
            }
        }
        assert_eq!(majority_hash(&m, 1, 39, ALL), Some(7039));
        assert_eq!(majority_hash(&m, 1, 30, ALL), Some(7030));
        assert_eq!(majority_hash(&m, 1, 5, ALL), None, "no longer kept");
        // Replica 6 restarts from an older checkpoint: what it said before no longer counts.
        announce(&mut m, 6, 20, 2, 7);
        assert_eq!(majority_hash(&m, 1, 30, ALL), None);
        assert_eq!(majority_hash(&m, 1, 20, ALL), Some(7020));
        // Replica 8's later announcement of the same round (it re-synced) replaces its claim.
        let mut a = at_round(1, 39, Some(3039));
        a.seq = 40;
        a.incarnation = 1;
        m.update(PeerKey(8), a, Duration::ZERO);
        assert_eq!(m.get(PeerKey(8)).and_then(|x| x.hash_at(39)), Some(3039));
    }
}
