//! A peer's connections by rail and direction, with what each one carries: the peer's
//! incarnation it was made with, the queue pair numbers of both ends, and the peer's grant keys
//! on it (they live and go with the connection).

use std::sync::Arc;

use crate::runtime::ConnId;

use super::grants::GrantKeys;

/// A peer's connections by rail: those this agent set up (outbound) and those the peer set up
/// to us (inbound). Transfers use the outbound one, else the inbound one. Kept apart so that
/// two agents connecting to each other at once never replace (and flush) each other's
/// connection. Each records the peer's incarnation (metadata generation) it was made with, so
/// that a re-joined peer's old connections are closed and its new ones kept, whichever of its
/// new metadata and its first connection arrives first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Conns {
    outbound: Vec<Option<Slot>>,
    inbound: Vec<Option<Slot>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    conn: ConnId,
    /// The peer's generation when it was made (0: unknown).
    generation: u64,
    qpns: QpNumbers,
    /// The peer's grant keys on this connection (NIC grants; `None` until received).
    keys: Option<Arc<GrantKeys>>,
}

/// A connection just made, as [`Inner::set_conn`](super::Inner::set_conn) records it.
pub(crate) struct NewConn {
    pub conn: ConnId,
    /// The peer's incarnation it was made with (`None`: the one loaded now).
    pub generation: Option<u64>,
    pub qpns: QpNumbers,
    /// Our grant keys on it, when the peer sent them.
    pub keys: Option<GrantKeys>,
}

/// The queue pair numbers of a connection's two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct QpNumbers {
    /// Ours.
    pub local: u32,
    /// The peer's.
    pub peer: u32,
}

/// Which of a peer's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Set up by this agent.
    Outbound,
    /// Set up by the peer.
    Inbound,
}

impl Conns {
    fn side(&mut self, dir: Direction) -> &mut Vec<Option<Slot>> {
        match dir {
            Direction::Outbound => &mut self.outbound,
            Direction::Inbound => &mut self.inbound,
        }
    }

    /// The slots on `rail`: ours first, then the peer's.
    fn slots(&self, rail: usize) -> impl Iterator<Item = &Slot> {
        [&self.outbound, &self.inbound]
            .into_iter()
            .filter_map(move |v| v.get(rail).and_then(Option::as_ref))
    }

    /// The slot transfers on `rail` use: ours, else the peer's.
    fn active(&self, rail: usize) -> Option<&Slot> {
        self.slots(rail).next()
    }

    /// The connection transfers on `rail` use.
    pub fn get(&self, rail: usize) -> Option<ConnId> {
        self.active(rail).map(|s| s.conn)
    }

    /// The peer's grant keys on `conn` (on `rail`), if received.
    pub fn keys(&self, rail: usize, conn: ConnId) -> Option<&Arc<GrantKeys>> {
        self.slot(rail, conn).and_then(|s| s.keys.as_ref())
    }

    /// The queue pair numbers of `conn` on `rail`.
    pub fn qpns(&self, rail: usize, conn: ConnId) -> Option<QpNumbers> {
        self.slot(rail, conn).map(|s| s.qpns)
    }

    /// Whether `conn` is one of the connections on `rail`.
    pub fn holds(&self, rail: usize, conn: ConnId) -> bool {
        self.slot(rail, conn).is_some()
    }

    /// Our connection on `rail` whose queue pair is `qpn`.
    pub fn by_local_qpn(&self, rail: usize, qpn: u32) -> Option<ConnId> {
        self.slots(rail)
            .find(|s| s.qpns.local == qpn)
            .map(|s| s.conn)
    }

    fn slot(&self, rail: usize, conn: ConnId) -> Option<&Slot> {
        self.slots(rail).find(|s| s.conn == conn)
    }

    /// Records the peer's grant keys on `conn` (on `rail`); whether the connection is there.
    pub fn set_keys(&mut self, rail: usize, conn: ConnId, keys: Arc<GrantKeys>) -> bool {
        for v in [&mut self.outbound, &mut self.inbound] {
            if let Some(Some(s)) = v.get_mut(rail) {
                if s.conn == conn {
                    s.keys = Some(keys);
                    return true;
                }
            }
        }
        false
    }

    /// Records `conn` (its queue pairs `qpns`, the peer's first `keys`), made with the peer's
    /// incarnation `generation`, on `rail`; returns the one of that direction it replaces.
    pub fn set(
        &mut self,
        dir: Direction,
        rail: usize,
        conn: ConnId,
        generation: u64,
        qpns: QpNumbers,
        keys: Option<Arc<GrantKeys>>,
    ) -> Option<ConnId> {
        let v = self.side(dir);
        if v.len() <= rail {
            v.resize(rail + 1, None);
        }
        v[rail]
            .replace(Slot {
                conn,
                generation,
                qpns,
                keys,
            })
            .map(|s| s.conn)
    }

    /// Removes `conn` from `rail` (either direction); whether it was there.
    pub fn remove(&mut self, rail: usize, conn: ConnId) -> bool {
        for dir in [Direction::Outbound, Direction::Inbound] {
            if let Some(slot) = self.side(dir).get_mut(rail) {
                if slot.as_ref().is_some_and(|s| s.conn == conn) {
                    *slot = None;
                    return true;
                }
            }
        }
        false
    }

    /// Every connection not made with incarnation `generation` (all of them with `None`),
    /// with its rail, removed.
    pub fn take_except(&mut self, generation: Option<u64>) -> Vec<(usize, ConnId)> {
        let mut all = Vec::new();
        for v in [&mut self.outbound, &mut self.inbound] {
            for (rail, slot) in v.iter_mut().enumerate() {
                if slot
                    .as_ref()
                    .is_some_and(|s| Some(s.generation) != generation)
                {
                    all.extend(slot.take().map(|s| (rail, s.conn)));
                }
            }
        }
        all
    }

    /// Every connection, with its rail, removed.
    pub fn take(&mut self) -> Vec<(usize, ConnId)> {
        self.take_except(None)
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.outbound.iter().chain(&self.inbound).flatten().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_keys_live_with_their_connection_and_a_connection_is_found_by_its_queue_pair() {
        let mut c = Conns::default();
        let qpns = QpNumbers {
            local: 17,
            peer: 33,
        };
        c.set(Direction::Inbound, 1, ConnId(4), 1, qpns, None);
        assert_eq!(c.by_local_qpn(1, 17), Some(ConnId(4)));
        assert_eq!(c.by_local_qpn(0, 17), None, "another rail");
        assert_eq!(c.by_local_qpn(1, 33), None, "the peer's number is not ours");
        assert!(c.keys(1, ConnId(4)).is_none());
        let keys = Arc::new(GrantKeys {
            by_region: [(5, 0x77)].into_iter().collect(),
        });
        assert!(c.set_keys(1, ConnId(4), Arc::clone(&keys)));
        assert!(
            !c.set_keys(1, ConnId(5), Arc::clone(&keys)),
            "no such connection"
        );
        assert_eq!(c.keys(1, ConnId(4)), Some(&keys));
        assert_eq!(c.qpns(1, ConnId(4)), Some(qpns));
        // A replacement starts without the old connection's keys.
        c.set(Direction::Inbound, 1, ConnId(6), 1, qpns, None);
        assert!(c.keys(1, ConnId(6)).is_none() && !c.holds(1, ConnId(4)));
    }

    #[test]
    fn transfers_use_the_outbound_connection_else_the_inbound_one_and_removal_is_by_id() {
        let mut c = Conns::default();
        assert_eq!(c.get(0), None);
        assert_eq!(
            c.set(
                Direction::Inbound,
                0,
                ConnId(7),
                1,
                QpNumbers::default(),
                None
            ),
            None
        );
        assert_eq!(
            c.get(0),
            Some(ConnId(7)),
            "the peer's connection serves us too"
        );
        assert_eq!(
            c.set(
                Direction::Outbound,
                0,
                ConnId(3),
                1,
                QpNumbers::default(),
                None
            ),
            None
        );
        assert_eq!(c.get(0), Some(ConnId(3)), "ours first");
        assert_eq!(
            c.set(
                Direction::Inbound,
                2,
                ConnId(9),
                1,
                QpNumbers::default(),
                None
            ),
            None
        );
        assert_eq!((c.get(1), c.get(2)), (None, Some(ConnId(9))));
        assert_eq!(c.len(), 3);
        // A new inbound connection replaces only the peer's earlier one.
        assert_eq!(
            c.set(
                Direction::Inbound,
                0,
                ConnId(8),
                1,
                QpNumbers::default(),
                None
            ),
            Some(ConnId(7))
        );
        assert_eq!(c.get(0), Some(ConnId(3)));
        // Removal names the connection: a stale id removes nothing.
        assert!(!c.remove(0, ConnId(7)));
        assert!(c.remove(0, ConnId(3)));
        assert_eq!(c.get(0), Some(ConnId(8)), "the inbound one is left");
        let mut all = c.take();
        all.sort_by_key(|&(rail, conn)| (rail, conn.0));
        assert_eq!(all, vec![(0, ConnId(8)), (2, ConnId(9))]);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn a_rejoined_peer_loses_its_old_incarnations_connections_and_keeps_its_new_ones() {
        let mut c = Conns::default();
        c.set(
            Direction::Outbound,
            0,
            ConnId(1),
            10,
            QpNumbers::default(),
            None,
        );
        c.set(
            Direction::Inbound,
            1,
            ConnId(2),
            10,
            QpNumbers::default(),
            None,
        );
        // The new incarnation (generation 11) connected to us before its metadata arrived.
        c.set(
            Direction::Inbound,
            0,
            ConnId(3),
            11,
            QpNumbers::default(),
            None,
        );
        let mut stale = c.take_except(Some(11));
        stale.sort_by_key(|&(rail, conn)| (rail, conn.0));
        assert_eq!(stale, vec![(0, ConnId(1)), (1, ConnId(2))]);
        assert_eq!((c.get(0), c.len()), (Some(ConnId(3)), 1));
    }
}
