//! Inbound connections per remote IP address, on both endpoints (libp2p and the direct one):
//! keys are free, addresses are not, so one host cannot take every connection slot by
//! presenting many identities.

use libp2p::PeerId;
use libp2p::core::transport::PortUse;
use libp2p::core::{ConnectedPoint, Endpoint, Multiaddr};
use libp2p::swarm::behaviour::ConnectionEstablished;
use libp2p::swarm::{
    ConnectionClosed, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler,
    THandlerInEvent, THandlerOutEvent, ToSwarm, dummy,
};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// Inbound connection slots by remote IP, shared by the endpoints.
#[derive(Clone, Debug)]
pub struct IpSlots {
    max_per_ip: usize,
    taken: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// Why an inbound connection was refused.
#[derive(Debug, thiserror::Error)]
#[error("{ip} already holds {max} inbound connections")]
pub struct TooManyFromIp {
    ip: IpAddr,
    max: usize,
}

impl IpSlots {
    /// At most `max_per_ip` inbound connections from one address at once.
    pub fn new(max_per_ip: usize) -> Self {
        IpSlots {
            max_per_ip,
            taken: Arc::default(),
        }
    }

    /// Takes a slot for a connection from `ip`, if one is free.
    pub fn take(&self, ip: IpAddr) -> Result<(), TooManyFromIp> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let n = taken.entry(ip).or_insert(0);
        if *n >= self.max_per_ip {
            return Err(TooManyFromIp {
                ip,
                max: self.max_per_ip,
            });
        }
        *n += 1;
        Ok(())
    }

    /// Gives back a slot taken for `ip`.
    pub fn release(&self, ip: IpAddr) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = taken.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                taken.remove(&ip);
            }
        }
    }
}

/// The libp2p side: refuses an established inbound connection whose address is full.
pub struct Behaviour {
    slots: IpSlots,
    held: HashMap<ConnectionId, IpAddr>,
}

impl Behaviour {
    /// Limits libp2p's inbound connections through `slots`.
    pub fn new(slots: IpSlots) -> Self {
        Behaviour {
            slots,
            held: HashMap::new(),
        }
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        // A relayed connection's address is the relay's; the relay limits its circuits.
        if remote
            .iter()
            .any(|p| p == libp2p::multiaddr::Protocol::P2pCircuit)
        {
            return Ok(dummy::ConnectionHandler);
        }
        if let Some(ip) = super::multiaddr_ip(remote) {
            self.slots.take(ip).map_err(ConnectionDenied::new)?;
            self.held.insert(connection_id, ip);
        }
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role: Endpoint,
        _port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => {
                if let Some(ip) = self.held.remove(&connection_id) {
                    self.slots.release(ip);
                }
            }
            FromSwarm::ConnectionEstablished(ConnectionEstablished {
                connection_id,
                endpoint: ConnectedPoint::Dialer { .. },
                ..
            }) => {
                // Only inbound connections hold slots.
                debug_assert!(!self.held.contains_key(&connection_id));
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _connection: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_per_address_and_come_back() {
        let slots = IpSlots::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        assert!(slots.take(a).is_ok());
        assert!(slots.take(a).is_ok());
        assert!(slots.take(a).is_err());
        assert!(slots.take(b).is_ok());
        slots.release(a);
        assert!(slots.take(a).is_ok());
    }
}
