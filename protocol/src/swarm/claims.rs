//! Sample counts checked against the routes: what a replica's averaging share claims it was
//! computed on, against what the replicas that worked with it say it committed.
//!
//! A share is a sum over samples with a claimed count, and the part owner weighs it by that
//! count (capped at the median claim, see [`super::robust`]). A replica that claims more than
//! it computed shrinks its per-sample mean toward zero and takes a typical member's weight: it
//! dilutes every round's update without pointing against it, so neither the support score
//! nor the vote on the parts sees it.
//!
//! Others know what the routes did. A driver commits a microbatch along its whole route and so
//! knows, per round, how many samples each hop of each later stage committed for it; a
//! second-stage replica knows how many each driver committed with it. These **witnesses**
//! announce their tallies ([`Routed`], for their last [`ROUTED_ROUNDS`] complete rounds): the
//! drivers for every later stage, the second stage for the drivers. A replica records the
//! claims its stage-mates' shares made in each round it reduced a part of, and once every
//! witness that worked with the stage just before a round has announced it, compares each claim
//! with what the witnesses committed with that member. A member's **credit** is that over what
//! it claimed, over its last [`CHECK_WINDOW`] checked rounds (sums, so a microbatch counted a
//! round apart by a witness and the member still adds up, with one round's worth forgiven for
//! the window's edge), at most 1; the owner multiplies the member's weight by it. A replica
//! that claims F times its samples weighs about what its routes carried.
//!
//! The credit lowers a weight and accuses nobody: a tally is the witness's word against the
//! member's, and without signatures nobody can tell which lied. A lying witness that
//! under-reports its work with an honest replica lowers that replica's weight, which a driver
//! could as well do by not routing to it; a ban on that evidence would let colluding witnesses
//! remove honest replicas.

use super::PeerKey;
use super::message::{Routed, RoutedRows};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Complete rounds a witness's announcement covers: announcements reach replicas of distant
/// stages by gossip every half second, and on a fast stage a round takes tens of milliseconds.
pub const ROUTED_ROUNDS: u64 = 32;

/// Entries in one announcement's [`Routed`], at most (a driver commits at most its share of
/// each round's microbatches, each through one hop per later stage; a second-stage replica
/// works for at most every driver).
pub const MAX_ROUTED: usize = 2048;

/// Hops whose rows one round keeps, at most: a stage holds no more replicas than the
/// membership (hops not yet known count, so that a replica heard of late is not missed).
const MAX_HOPS: usize = super::membership::MAX_MEMBERS;

/// Checked rounds a member's credit is judged over.
pub const CHECK_WINDOW: usize = 16;

/// Checked rounds needed before a member's credit is judged at all.
const CHECK_MIN: usize = 3;

/// The least credit: a share never vanishes from the weights (they must not all be zero).
pub const MIN_CREDIT: f64 = 1.0 / 64.0;

/// A credit below this is told as an event ([`super::Event::Discounted`]), once per fall.
pub const DISCOUNTED: f64 = 0.5;

/// Rounds a claim waits for the witnesses' announcements, at most.
const PENDING_ROUNDS: u64 = 2 * ROUTED_ROUNDS;

/// The stage whose replicas witness `stage`'s claims: the second stage the drivers', the
/// drivers every later stage's.
pub fn witnesses_of(stage: u32) -> u32 {
    if stage == 0 { 1 } else { 0 }
}

/// A witness's record of the samples it committed with each replica it checks for, by round:
/// a driver's through each later hop, a second-stage replica's for each driver.
#[derive(Debug, Default)]
pub struct Tallies {
    rounds: BTreeMap<u64, BTreeMap<PeerKey, u32>>,
}

impl Tallies {
    /// A microbatch of `rows` samples counted toward `round` was committed with `peers` (a
    /// driver: its route's later hops; a second-stage replica: the driver).
    pub fn record(&mut self, round: u64, peers: &[PeerKey], rows: u32) {
        let tally = self.rounds.entry(round).or_default();
        for &peer in peers {
            let n = tally.entry(peer).or_default();
            *n = n.saturating_add(rows);
        }
        // Commits count toward the round being collected or the next; older ones are done.
        while self.rounds.len() as u64 > ROUTED_ROUNDS + 2 {
            self.rounds.pop_first();
        }
    }

    /// What to announce when this peer has completed `completed` rounds and last told the
    /// same listeners up to `told`: the tallies of rounds `told .. completed` (at most the
    /// last [`ROUTED_ROUNDS`]; a round without an entry had none), within [`MAX_ROUTED`]
    /// entries (the newest rounds first; the first round covered moves up past those left out).
    pub fn routed(&self, told: u64, completed: u64) -> Routed {
        let mut first = told
            .max(completed.saturating_sub(ROUTED_ROUNDS))
            .min(completed);
        let mut rows = Vec::new();
        for (&round, tally) in self.rounds.range(first..completed).rev() {
            if rows.len() + tally.len() > MAX_ROUTED {
                first = round + 1;
                break;
            }
            let tallied = tally
                .iter()
                .map(|(&hop, &rows)| RoutedRows { round, hop, rows });
            rows.extend(tallied);
        }
        Routed { first, rows }
    }
}

/// What the witnesses saw of one round: who has told, and the samples they committed with
/// each replica of this peer's stage.
#[derive(Debug, Default)]
struct Witnessed {
    witnesses: BTreeSet<PeerKey>,
    rows: BTreeMap<PeerKey, f64>,
}

/// A witness that worked with this stage within this many rounds before a round may have
/// worked in it too: the round is checked only once it has told.
const ACTIVE_ROUNDS: u64 = 4;

/// One replica's check of its stage-mates' claims (see the module's documentation).
#[derive(Debug, Default)]
pub(super) struct ClaimCheck {
    /// Per round, the witnesses' tallies heard, summed per member (the first announcement of
    /// a round by a witness counts: a complete round's tally never changes, and a witness
    /// restarted with an empty record must not erase it).
    witnessed: BTreeMap<u64, Witnessed>,
    /// Per witness that worked with this stage, the newest round it did. Only such witnesses
    /// are waited for: an identity that announces itself a replica and never works (or
    /// announces an old round forever) holds no check.
    active: BTreeMap<PeerKey, u64>,
    /// Per round, each member's claimed samples, until the round can be checked.
    claims: BTreeMap<u64, BTreeMap<PeerKey, f64>>,
    /// Per member, (claimed, witnessed) of its last checked rounds.
    checked: BTreeMap<PeerKey, VecDeque<(f64, f64)>>,
    /// The newest round claims were recorded for (what is kept is relative to it).
    newest: u64,
}

impl ClaimCheck {
    /// A witness that completed `completed` rounds announced `routed`; `mine` says which peers
    /// may be replicas of this peer's stage (only they are checked here).
    pub fn heard(
        &mut self,
        witness: PeerKey,
        completed: u64,
        routed: &Routed,
        mine: impl Fn(PeerKey) -> bool,
    ) {
        let first = (routed.first)
            .max(completed.saturating_sub(ROUTED_ROUNDS))
            .max(self.newest.saturating_sub(PENDING_ROUNDS));
        let last = completed.min(self.newest.saturating_add(PENDING_ROUNDS));
        // The rounds this witness tells of for the first time; then one pass over its rows.
        let fresh: BTreeSet<u64> = (first..last)
            .filter(|round| {
                let w = self.witnessed.entry(*round).or_default();
                w.witnesses.insert(witness)
            })
            .collect();
        for r in routed.rows.iter().filter(|r| fresh.contains(&r.round)) {
            let Some(w) = self.witnessed.get_mut(&r.round) else {
                continue;
            };
            if !mine(r.hop) || (w.rows.len() >= MAX_HOPS && !w.rows.contains_key(&r.hop)) {
                continue;
            }
            *w.rows.entry(r.hop).or_default() += f64::from(r.rows);
            let newest = self.active.entry(witness).or_default();
            *newest = (*newest).max(r.round);
        }
    }

    /// Whether `witness` worked with this stage lately (its announcements are awaited even
    /// when they tell of no work).
    pub fn waits_for(&self, witness: PeerKey) -> bool {
        self.active.contains_key(&witness)
    }

    /// The shares of round `round` claimed these sample counts.
    pub fn claimed(&mut self, round: u64, claims: &[(PeerKey, f64)]) {
        self.newest = self.newest.max(round);
        let c = self.claims.entry(round).or_default();
        for &(peer, samples) in claims {
            if samples.is_finite() && samples > 0.0 {
                c.entry(peer).or_insert(samples);
            }
        }
        let oldest = self.newest.saturating_sub(PENDING_ROUNDS);
        self.claims.retain(|r, _| *r >= oldest);
        self.witnessed.retain(|r, _| *r >= oldest);
        self.active.retain(|_, r| *r >= oldest);
    }

    /// Checks every round that every witness that may have worked in it has told of.
    pub fn settle(&mut self) {
        let rounds: Vec<u64> = self.claims.keys().copied().collect();
        for round in rounds {
            let Some(w) = self.witnessed.get(&round) else {
                continue;
            };
            let mut active = self
                .active
                .iter()
                .filter(|(_, r)| r.saturating_add(ACTIVE_ROUNDS) >= round);
            if !active.all(|(k, _)| w.witnesses.contains(k)) {
                continue;
            }
            let Some(mut claims) = self.claims.remove(&round) else {
                continue;
            };
            // A member that claimed nothing here though the witnesses worked with it (it was
            // left out of the round, and its samples went into its next claim) counts as
            // claiming nothing: its next round's claim is larger by as much, and the window's
            // sums agree again.
            for &peer in w.rows.keys() {
                if self.checked.contains_key(&peer) {
                    claims.entry(peer).or_insert(0.0);
                }
            }
            for (peer, claimed) in claims {
                let witnessed = w.rows.get(&peer).copied().unwrap_or(0.0);
                let window = self.checked.entry(peer).or_default();
                window.push_back((claimed, witnessed));
                if window.len() > CHECK_WINDOW {
                    window.pop_front();
                }
            }
        }
    }

    /// The factor on `peer`'s weight: what the witnesses saw over what it claimed, over
    /// its checked rounds, within [`MIN_CREDIT`] and 1 (1 until enough are checked).
    pub fn credit(&self, peer: PeerKey) -> f64 {
        let Some(window) = self.checked.get(&peer).filter(|w| w.len() >= CHECK_MIN) else {
            return 1.0;
        };
        let (claimed, witnessed) = window
            .iter()
            .fold((0.0, 0.0), |(c, w), (a, b)| (c + a, w + b));
        if claimed <= 0.0 {
            return 1.0;
        }
        // Samples a witness counted toward one round and the member toward the next (a round
        // that went on without it, a microbatch committed as its round closed) leave the
        // window's first round short: at most a round's worth is forgiven.
        let shifted = window.iter().map(|w| w.1).fold(0.0, f64::max);
        ((witnessed + shifted) / claimed).clamp(MIN_CREDIT, 1.0)
    }

    /// The members whose credit is below 1, with it.
    pub fn credits(&self) -> BTreeMap<PeerKey, f64> {
        self.checked
            .keys()
            .map(|&k| (k, self.credit(k)))
            .filter(|(_, c)| *c < 1.0)
            .collect()
    }

    /// `peer` left: its claims and record go (its tallies as a witness stay: it may have
    /// worked in rounds not yet checked).
    pub fn forget(&mut self, peer: PeerKey) {
        self.checked.remove(&peer);
        for c in self.claims.values_mut() {
            c.remove(&peer);
        }
    }

    /// This peer's stage changed: nothing checked of the last one applies.
    pub fn clear(&mut self) {
        *self = ClaimCheck::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: PeerKey = PeerKey(10);
    const N: PeerKey = PeerKey(11);
    const D1: PeerKey = PeerKey(1);
    const D2: PeerKey = PeerKey(2);

    fn driver(rounds: &[(u64, &[(PeerKey, u32)])]) -> Tallies {
        let mut t = Tallies::default();
        for &(round, hops) in rounds {
            for &(hop, rows) in hops {
                t.record(round, &[hop], rows);
            }
        }
        t
    }

    fn all(_: PeerKey) -> bool {
        true
    }

    /// A member that claims what its routes carried keeps its full weight; one that claims
    /// four times as much weighs about a quarter, once the drivers of those rounds have told.
    #[test]
    fn a_claim_beyond_the_routes_lowers_the_weight_to_what_they_carried() {
        let mut check = ClaimCheck::default();
        let d1 = driver(&[(0, &[(M, 8), (N, 8)]), (1, &[(M, 8)]), (2, &[(N, 16)])]);
        let d2 = driver(&[(0, &[(M, 8)]), (1, &[(N, 8), (M, 8)]), (2, &[(M, 16)])]);
        for round in 0..3 {
            let (m, n) = [(16.0, 8.0), (16.0, 8.0), (16.0, 16.0)][round as usize];
            check.claimed(round, &[(M, 4.0 * m), (N, n)]);
        }
        check.settle();
        assert_eq!(check.credit(M), 1.0, "nothing heard from the drivers yet");
        check.heard(D1, 2, &d1.routed(0, 2), all);
        check.heard(D2, 2, &d2.routed(0, 2), all);
        check.heard(D1, 3, &d1.routed(0, 3), all);
        check.settle();
        assert_eq!(
            check.checked[&M].len(),
            2,
            "round 2 waits for D2, which routed in round 1"
        );
        check.heard(D2, 3, &d2.routed(0, 3), all);
        check.settle();
        // Witnessed 48 of 192 claimed, with one round's 16 forgiven.
        let credit = check.credit(M);
        assert!((credit - 64.0 / 192.0).abs() < 1e-12, "{credit}");
        assert_eq!(check.credit(N), 1.0);
        assert_eq!(check.credits().keys().copied().collect::<Vec<_>>(), [M]);
    }

    /// A microbatch a driver counted toward one round and the hop toward the next still adds
    /// up over the window; a restarted driver's empty ledger does not erase what it told
    /// before; a driver that routed lately and went silent holds the check, one that never
    /// routed through the stage does not.
    #[test]
    fn shifted_counts_add_up_and_only_drivers_that_routed_are_awaited() {
        let mut check = ClaimCheck::default();
        // Rounds 0-3: 8 samples a round through M, the second microbatch of round 1 counted
        // by M in round 2.
        let d1 = driver(&[
            (0, &[(M, 8)]),
            (1, &[(M, 16)]),
            (2, &[(M, 8)]),
            (3, &[(M, 8)]),
        ]);
        let claims = [8.0, 8.0, 16.0, 8.0];
        for (round, c) in claims.iter().enumerate() {
            check.claimed(round as u64, &[(M, *c)]);
        }
        check.heard(D1, 4, &d1.routed(0, 4), all);
        // Restarted: it announces the same rounds with nothing routed.
        check.heard(D1, 4, &Routed::default(), all);
        check.settle();
        assert_eq!(check.credit(M), 1.0);
        assert_eq!(check.checked[&M].len(), 4);
        // D2 routed in round 3 (through another stage's replica too) and went silent: round 4
        // waits for it; a driver that never routed through this stage is not waited for.
        let d2 = driver(&[(3, &[(N, 8), (PeerKey(99), 8)])]);
        check.heard(D2, 4, &d2.routed(0, 4), |k| k != PeerKey(99));
        check.claimed(4, &[(M, 8.0)]);
        check.heard(D1, 5, &driver(&[(4, &[(M, 8)])]).routed(0, 5), all);
        check.settle();
        assert_eq!(check.checked[&M].len(), 4, "round 4 not checked without D2");
        check.heard(D2, 5, &Routed::default(), all);
        check.settle();
        assert_eq!(check.checked[&M].len(), 5);
        assert_eq!(check.credit(M), 1.0);
        assert!(!check.active.contains_key(&PeerKey(99)));
    }

    /// What a witness announces covers the rounds since it last told, within its window and
    /// its bound, newest rounds first (the rounds it leaves out are not claimed covered); what
    /// a replica keeps stays within a window of rounds whatever witnesses announce.
    #[test]
    fn announcements_and_records_are_bounded() {
        let mut t = Tallies::default();
        for round in 0..100 {
            let hops: Vec<PeerKey> = (0..100).map(PeerKey).collect();
            t.record(round, &hops, 1);
        }
        let since = t.routed(97, 100);
        assert_eq!((since.first, since.rows.len()), (97, 300));
        let r = t.routed(0, 100);
        assert!(r.rows.len() <= MAX_ROUTED);
        // 20 rounds of 100 hops fit.
        assert_eq!(r.first, 80);
        assert!(r.rows.iter().all(|x| (80..100).contains(&x.round)));
        assert_eq!(r.rows.first().map(|x| x.round), Some(99));
        let mut check = ClaimCheck::default();
        for round in 0..1000 {
            check.claimed(round, &[(M, 8.0)]);
            check.heard(PeerKey(round), round + 1, &r, all);
        }
        assert!(check.claims.len() as u64 <= PENDING_ROUNDS + 1);
        assert!(check.witnessed.len() as u64 <= PENDING_ROUNDS + 1);
        assert!(check.active.len() as u64 <= PENDING_ROUNDS + 1);
        check.heard(D1, u64::MAX, &r, all);
        assert!(check.witnessed.len() as u64 <= PENDING_ROUNDS + 1);
    }
}
