//! Cache events (what vLLM and SGLang publish so a cluster router can send a request to the
//! replica that holds its prefix) and their subscription.
//!
//! Subscription is by channel: [`BlockPool::subscribe`](crate::BlockPool::subscribe) returns an
//! unbounded `crossbeam_channel::Receiver`, so a publisher thread (a ZMQ or HTTP bridge) can block
//! on it while the engine thread keeps the pool. Events are delivered in the order the pool
//! changed. A dropped receiver is forgotten at the next event. With no subscriber, no event is
//! built, so the hot paths pay nothing. A subscriber that never drains its receiver grows it
//! without bound: drain it, or drop it.
//!
//! Invariant: for every key, `BlockStored` and `BlockRemoved` alternate (stored first), and
//! `AllCleared` stands for a `BlockRemoved` of every key stored and not yet removed.

use crossbeam_channel::{Receiver, Sender};

use crate::{BlockHash, ExtraKey};

/// One change of the prefix cache's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block was registered under `hash`.
    BlockStored {
        /// The block's key.
        hash: BlockHash,
        /// The key of the block before it in its sequence, `None` for a first block.
        parent: Option<BlockHash>,
        /// The block's tokens (`block_size` of them).
        tokens: Vec<u32>,
        /// The adapter and salt the key was computed with.
        extra: ExtraKey,
    },
    /// The block keyed `hash` left the cache (evicted for reuse).
    BlockRemoved {
        /// The removed key.
        hash: BlockHash,
    },
    /// Every cached key was dropped at once.
    AllCleared,
}

/// The senders of every live subscription.
#[derive(Debug, Default)]
pub(crate) struct EventBus {
    senders: Vec<Sender<CacheEvent>>,
}

impl EventBus {
    pub(crate) fn subscribe(&mut self) -> Receiver<CacheEvent> {
        let (sender, receiver) = crossbeam_channel::unbounded();
        self.senders.push(sender);
        receiver
    }

    /// Live subscriptions (as of the last event).
    pub(crate) fn subscriber_count(&self) -> usize {
        self.senders.len()
    }

    /// Whether anyone listens; callers skip building events otherwise.
    pub(crate) fn is_active(&self) -> bool {
        !self.senders.is_empty()
    }

    /// Sends `event` to every subscriber and forgets those whose receiver is gone.
    pub(crate) fn publish(&mut self, event: CacheEvent) {
        let last = self.senders.len().saturating_sub(1);
        let mut index = 0;
        let mut event = Some(event);
        self.senders.retain(|sender| {
            let this = index;
            index += 1;
            // The last subscriber gets the event itself, the others a clone.
            let to_send = if this == last {
                event.take()
            } else {
                event.clone()
            };
            match to_send {
                Some(e) => sender.send(e).is_ok(),
                None => true,
            }
        });
    }
}
