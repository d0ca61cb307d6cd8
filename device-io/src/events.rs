//! Prefix-cache events: what a router publishes when the contents of its prefix cache change, so
//! that a cluster router can send each request to the replica that already holds its prefix (the
//! KV events vLLM publishes as `BlockStored`, `BlockRemoved` and `AllBlocksCleared` for llm-d's
//! and Dynamo's KV-aware routing, and SGLang's equivalents).
//!
//! # The stream
//!
//! A subscriber hands [`DeviceIo::subscribe_cache_events`](crate::DeviceIo::subscribe_cache_events)
//! a [`CacheEventSink`]. The router first delivers one [`CacheEvent::BlockStored`] for every block
//! its prefix cache holds at that moment, each after its parent (so a subscriber that joins late,
//! or comes back after falling behind, starts from the true contents), then every change, in the
//! order the cache changed. A subscriber's view is exact: the set of keys stored and not removed
//! since (an [`CacheEvent::AllBlocksCleared`] removes every key) is, whenever the router is between
//! two calls, exactly the set of blocks the prefix cache holds.
//!
//! Invariants of one subscription's stream: for every key, `BlockStored` and `BlockRemoved`
//! alternate, stored first (`AllBlocksCleared` stands for a `BlockRemoved` of every key stored and
//! not yet removed); a `BlockStored` whose `parent` is `Some(p)` comes while `p` is stored.
//!
//! # Keys
//!
//! A [`BlockKey`] is a hash chain: the key of a block is a hash of its parent's key (for a first
//! block, of its namespace: the LoRA adapter and the cache salt) and its tokens. Equal keys mean
//! equal prefixes in the same namespace (up to the collisions of a 64- or 128-bit hash). The events
//! carry the tokens and the parent key too, so a cluster router may build its own index from them
//! (a radix tree of tokens per replica) without knowing the router's hash.
//!
//! # Delivery
//!
//! The router calls the sink on the thread that changed the cache, with the router's own state
//! locked: a sink must never block and should return at once (hand the event to a channel). A
//! sink that answers `false` (its subscriber is gone or cannot keep up) is dropped and receives
//! nothing more. With no subscription a router builds no event, so the hot path pays nothing.

/// The key of one full cached block; see the [module docs](self). With 64-bit keys the upper 64
/// bits are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlockKey(pub u128);

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// One change of a router's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block entered the prefix cache.
    BlockStored {
        /// The block's key.
        key: BlockKey,
        /// The key of the block before it in its sequence; `None` for a first block.
        parent: Option<BlockKey>,
        /// The block's tokens (the router's block size of them).
        tokens: Vec<u32>,
        /// The LoRA adapter that computed the block's K/V (`None`: the base model).
        lora_adapter: Option<u32>,
        /// The cache salt of the tenant whose requests may share the block (`None`: shared by
        /// every unsalted request).
        cache_salt: Option<u64>,
    },
    /// The block keyed `key` left the prefix cache (evicted for reuse, or cleared).
    BlockRemoved {
        /// The removed key.
        key: BlockKey,
    },
    /// Every cached block left the prefix cache at once.
    AllBlocksCleared,
}

/// The receiving end of one subscription to a router's cache events, as the router sees it.
///
/// `Send`, because a router hands it to whichever thread changes the cache. The engine's
/// implementation puts each event on a channel without blocking.
pub trait CacheEventSink: Send {
    /// Takes one event; answers whether the subscription goes on. Must not block: the router
    /// calls it with its state locked. After `false` the router drops the sink.
    fn deliver(&mut self, event: CacheEvent) -> bool;
}

impl std::fmt::Debug for dyn CacheEventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheEventSink")
    }
}

/// Every sink of a router's live subscriptions; what a router keeps to publish its events.
///
/// A sink that answers `false`, or panics, is dropped (a panicking sink loses its subscription,
/// never the router's call). With no sink, [`CacheEventBus::is_active`] is `false` and a router
/// builds no event.
#[derive(Debug, Default)]
pub struct CacheEventBus {
    sinks: Vec<Box<dyn CacheEventSink>>,
}

impl CacheEventBus {
    /// Adds a subscription.
    pub fn add(&mut self, sink: Box<dyn CacheEventSink>) {
        self.sinks.push(sink);
    }

    /// Whether anyone listens (as of the last event delivered).
    pub fn is_active(&self) -> bool {
        !self.sinks.is_empty()
    }

    /// Live subscriptions (as of the last event delivered).
    pub fn len(&self) -> usize {
        self.sinks.len()
    }

    /// Whether there is no subscription.
    pub fn is_empty(&self) -> bool {
        self.sinks.is_empty()
    }

    /// Delivers `event` to every sink (the last one gets the event itself, the others a clone)
    /// and drops the sinks that answer `false` or panic.
    pub fn publish(&mut self, event: CacheEvent) {
        let last = self.sinks.len().saturating_sub(1);
        let mut event = Some(event);
        let mut index = 0;
        self.sinks.retain_mut(|sink| {
            let this = index;
            index += 1;
            let to_send = if this == last {
                event.take()
            } else {
                event.clone()
            };
            let Some(to_send) = to_send else {
                return true;
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.deliver(to_send)))
                .unwrap_or(false)
        });
    }

    /// Delivers `event` to one new sink only (the contents a subscription starts with); answers
    /// whether the sink still wants events.
    pub fn deliver_to(sink: &mut dyn CacheEventSink, event: CacheEvent) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.deliver(event)))
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Recorder {
        events: Arc<Mutex<Vec<CacheEvent>>>,
        /// Answer `false` after this many events.
        limit: Option<usize>,
    }

    impl CacheEventSink for Recorder {
        fn deliver(&mut self, event: CacheEvent) -> bool {
            let mut events = self.events.lock().unwrap();
            events.push(event);
            self.limit.is_none_or(|limit| events.len() < limit)
        }
    }

    struct Panics;

    impl CacheEventSink for Panics {
        fn deliver(&mut self, _: CacheEvent) -> bool {
            panic!("a sink that panics")
        }
    }

    fn removed(key: u128) -> CacheEvent {
        CacheEvent::BlockRemoved { key: BlockKey(key) }
    }

    #[test]
    fn every_sink_gets_every_event_until_it_declines() {
        let mut bus = CacheEventBus::default();
        assert!(!bus.is_active());
        let keeps = Recorder::default();
        let stops = Recorder {
            limit: Some(2),
            ..Recorder::default()
        };
        bus.add(Box::new(keeps.clone()));
        bus.add(Box::new(stops.clone()));
        bus.add(Box::new(Panics));
        assert_eq!(bus.len(), 3);
        for key in 1..=3 {
            bus.publish(removed(key));
        }
        assert_eq!(
            *keeps.events.lock().unwrap(),
            [removed(1), removed(2), removed(3)]
        );
        // It declined with the second event, which it still got.
        assert_eq!(*stops.events.lock().unwrap(), [removed(1), removed(2)]);
        assert_eq!(bus.len(), 1);
        bus.publish(CacheEvent::AllBlocksCleared);
        assert_eq!(keeps.events.lock().unwrap().len(), 4);
    }

    #[test]
    fn a_panicking_new_sink_is_refused() {
        assert!(!CacheEventBus::deliver_to(&mut Panics, removed(1)));
        let mut recorder = Recorder::default();
        assert!(CacheEventBus::deliver_to(&mut recorder, removed(1)));
    }
}
