//! Subscriptions to the router's prefix-cache events ([`device_io::events`]): block stored, block
//! removed, all cleared, for a cluster router that sends each request to the replica holding its
//! prefix (what vLLM publishes as KV events for llm-d's and Dynamo's KV-aware routing).
//!
//! [`Engine::subscribe_cache_events`](crate::Engine::subscribe_cache_events) and
//! [`EngineClient::subscribe_cache_events`](crate::EngineClient::subscribe_cache_events) answer a
//! `crossbeam_channel::Receiver<CacheEvent>`. The stream starts with one `BlockStored` for every
//! block cached at that moment (parents first), then every change in order, so the keys stored
//! and not removed are, whenever the engine is between two steps, exactly the blocks the router's
//! prefix cache holds. Block keys are the router's hash chain (on the host router, `kv-cache`'s
//! xxh3 chain on both the attention-only and the hybrid path); events also carry the tokens and
//! the parent key.
//!
//! # A slow or vanished subscriber
//!
//! The engine never waits for a subscriber, and a subscriber's view is never silently wrong:
//!
//! - Each subscription has a *backlog*: the events sent and not yet received. An event that would
//!   exceed it ends the subscription instead of being queued: the receiver gets every event up to
//!   there, then sees the channel disconnected, and [`Metrics::cache_event_lags`] counts it. A
//!   subscriber that sees its channel end while the engine runs has fallen behind; it
//!   subscribes again, and the new stream starts from the cache's true contents. Dropping single
//!   events instead would leave the subscriber's view wrong with nothing to tell it so; an
//!   unbounded queue would let a stalled subscriber grow the engine's memory without bound.
//! - A dropped receiver ends its subscription at the next event.
//!
//! The default backlog ([`default_backlog`]) is twice the router's KV blocks (at least 4,096):
//! room for the starting contents and a complete turnover of the pool. A queued event is about
//! 100 bytes plus 4 bytes per token of a block. The channel allocates as events queue, not up
//! front.
//!
//! With no subscription the router builds no event, so the hot path is unchanged.
//!
//! # Example
//!
//! Subscribe, serve one request, and rebuild the cached set from the stream: it is exactly what
//! the router reports cached.
//!
//! ```
//! # #[cfg(feature = "cpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::collections::HashSet;
//!
//! use scheduler::backend::{self, BackendOptions};
//! use scheduler::{CacheEvent, EngineConfig, EngineThread, Request, ShutdownMode};
//!
//! let model = backend::random_model(backend::ModelConfig::tiny_demo(), 0)?;
//! let engine = backend::build_engine(model, BackendOptions::new(64, 4), EngineConfig::default())?;
//! let thread = EngineThread::spawn(engine)?;
//! let client = thread.client();
//!
//! // The blocks cached now (none yet), then every change, in order.
//! let events = client.subscribe_cache_events()?;
//! client.submit(Request::greedy((1..=40).collect(), 8))?.wait()?;
//! // Answered between two steps, after every event before it was sent.
//! let stats = client.stats()?;
//!
//! let mut cached = HashSet::new();
//! for event in events.try_iter() {
//!     match event {
//!         CacheEvent::BlockStored { key, parent, tokens, .. } => {
//!             println!("stored {key} after {parent:?}: {tokens:?}");
//!             cached.insert(key);
//!         }
//!         CacheEvent::BlockRemoved { key } => {
//!             cached.remove(&key);
//!         }
//!         CacheEvent::AllBlocksCleared => cached.clear(),
//!     }
//! }
//! assert_eq!(cached.len(), stats.facts.kv_blocks_cached);
//! assert_eq!(cached.len(), 2); // 47 computed tokens: two full blocks of 16
//! thread.shutdown(ShutdownMode::Drain)?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cpu"))]
//! # fn main() {}
//! ```
//!
//! [`Metrics::cache_event_lags`]: crate::Metrics::cache_event_lags

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use device_io::{CacheEvent, CacheEventSink, DeviceFacts};

/// The backlog a subscription gets unless it asks for another: twice the router's KV blocks, at
/// least 4,096 events.
pub fn default_backlog(facts: &DeviceFacts) -> NonZeroUsize {
    NonZeroUsize::new(facts.kv_blocks_total.saturating_mul(2).max(4096))
        .unwrap_or(NonZeroUsize::MIN)
}

/// One subscription as the router holds it: a channel whose backlog is bounded.
#[derive(Debug)]
pub(crate) struct ChannelSink {
    sender: Sender<CacheEvent>,
    backlog: usize,
    lags: Arc<AtomicU64>,
}

impl ChannelSink {
    /// A subscription with room for `backlog` unreceived events; `lags` counts those that fell
    /// behind.
    pub(crate) fn new(backlog: NonZeroUsize, lags: Arc<AtomicU64>) -> (Self, Receiver<CacheEvent>) {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let sink = ChannelSink {
            sender,
            backlog: backlog.get(),
            lags,
        };
        (sink, receiver)
    }
}

impl CacheEventSink for ChannelSink {
    fn deliver(&mut self, event: CacheEvent) -> bool {
        if self.sender.len() >= self.backlog {
            self.lags.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                backlog = self.backlog,
                "a cache-event subscriber fell behind; its subscription ends (it may subscribe again)"
            );
            return false;
        }
        // An error means the receiver is gone: the subscription ends quietly.
        self.sender.send(event).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use device_io::BlockKey;

    use super::*;

    fn removed(key: u128) -> CacheEvent {
        CacheEvent::BlockRemoved { key: BlockKey(key) }
    }

    #[test]
    fn a_full_backlog_ends_the_subscription_after_what_it_holds() {
        let lags = Arc::new(AtomicU64::new(0));
        let (mut sink, receiver) =
            ChannelSink::new(NonZeroUsize::new(2).unwrap(), Arc::clone(&lags));
        assert!(sink.deliver(removed(1)));
        assert!(sink.deliver(removed(2)));
        assert!(!sink.deliver(removed(3)));
        assert_eq!(lags.load(Ordering::Relaxed), 1);
        drop(sink);
        assert_eq!(
            receiver.iter().collect::<Vec<_>>(),
            [removed(1), removed(2)]
        );
    }

    #[test]
    fn a_receiver_that_keeps_up_is_never_cut_off() {
        let lags = Arc::new(AtomicU64::new(0));
        let (mut sink, receiver) =
            ChannelSink::new(NonZeroUsize::new(1).unwrap(), Arc::clone(&lags));
        for key in 0..100 {
            assert!(sink.deliver(removed(key)));
            assert_eq!(receiver.try_recv(), Ok(removed(key)));
        }
        assert_eq!(lags.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_dropped_receiver_ends_the_subscription_without_a_lag() {
        let lags = Arc::new(AtomicU64::new(0));
        let (mut sink, receiver) =
            ChannelSink::new(NonZeroUsize::new(8).unwrap(), Arc::clone(&lags));
        drop(receiver);
        assert!(!sink.deliver(removed(1)));
        assert_eq!(lags.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_default_backlog_holds_the_pool_twice() {
        let facts = |kv_blocks_total| DeviceFacts {
            kv_blocks_total,
            ..DeviceFacts::default()
        };
        assert_eq!(default_backlog(&facts(10)).get(), 4096);
        assert_eq!(default_backlog(&facts(100_000)).get(), 200_000);
    }
}
