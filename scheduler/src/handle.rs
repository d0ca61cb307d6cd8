//! The engine's public faces: a request's handle (its token stream and cancel), a cloneable
//! `Send` client, and the engine thread.
//!
//! Every handle and client talks to the engine through one command channel; the engine takes
//! commands at the start of each step (or blocks on them when idle, on its own thread).

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use device_io::{
    CacheEvent, DeviceError, DeviceFacts, DeviceIo, LoraAck, LoraCommand, LoraError, Sequence,
};

use crate::engine::{Engine, EngineError, Tracked};
use crate::event::{Event, FinishReason, ServeError, Usage};
use crate::metrics::Metrics;
use crate::request::{Limits, Request, RequestError};

/// What a client or handle asks of the engine.
#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<Tracked>),
    Cancel(u64),
    Shutdown(ShutdownMode),
    /// Answer a snapshot of the engine and its router.
    Stats(Sender<EngineStats>),
    /// Clear the router's prefix cache and answer how that went.
    ClearPrefixCache(Sender<Result<(), DeviceError>>),
    /// Subscribe to the prefix cache's events (with this backlog, or the default one).
    SubscribeCacheEvents {
        backlog: Option<NonZeroUsize>,
        answer: Sender<Result<Receiver<CacheEvent>, DeviceError>>,
    },
    /// Apply a LoRA command at the next quiescent point and answer its ack or error.
    Lora(LoraCommand, Sender<Result<LoraAck, ControlError>>),
}

/// A snapshot of an engine and its router, for monitoring and leak checks
/// ([`EngineClient::stats`], [`Engine::stats`]).
///
/// At idle (nothing waiting or running, no orphans) every live slot is free and every KV block is
/// free or kept by the prefix cache; after [`EngineClient::clear_prefix_cache`] every block is
/// free.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    /// The router's resources.
    pub facts: DeviceFacts,
    /// The engine's counters.
    pub metrics: Metrics,
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Sequences whose release the router refused twice and that still hold resources.
    pub orphans: usize,
    /// The error that lost the device, if one did.
    pub device_lost: Option<DeviceError>,
}

/// Why a control call of a client ([`EngineClient::stats`],
/// [`EngineClient::clear_prefix_cache`], [`EngineClient::subscribe_cache_events`],
/// [`EngineClient::lora`]) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The engine has stopped (its thread ended) and answers nothing.
    #[error("the engine has stopped")]
    EngineStopped,
    /// The router refused the operation.
    #[error("the router refused: {0}")]
    Router(#[from] DeviceError),
    /// A LoRA command was refused (by the engine, e.g. an unload while a request uses the
    /// adapter, or by the router); nothing changed.
    #[error("LoRA command refused: {0}")]
    Lora(#[from] LoraError),
}

/// How the engine treats requests still in flight at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Serve every accepted request to completion first (new submissions fail).
    Drain,
    /// Fail every request still waiting or running with [`ServeError::Shutdown`].
    Abort,
}

/// A submitted request: its id, its event stream, and a way to cancel it.
///
/// Dropping the handle does not cancel the request at once; the engine cancels it when it next
/// fails to deliver a token to the dropped stream.
#[derive(Debug)]
pub struct RequestHandle {
    id: u64,
    events: Receiver<Event>,
    commands: Sender<Command>,
}

/// A completed request's whole output.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Every generated token, in order.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub reason: FinishReason,
    /// What it used.
    pub usage: Usage,
    /// The logits digest, when the request asked for one.
    pub logits_digest: Option<u64>,
}

impl RequestHandle {
    pub(crate) fn new(id: u64, events: Receiver<Event>, commands: Sender<Command>) -> Self {
        RequestHandle {
            id,
            events,
            commands,
        }
    }

    /// The request's id (unique within its engine).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The stream: tokens, then one `Finished` or `Error`.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Asks the engine to cancel the request; it ends with `Finished { reason: Cancelled }`
    /// unless it ended before the engine saw the command.
    pub fn cancel(&self) {
        // A closed channel means the engine is gone, and so is the request.
        let _ = self.commands.send(Command::Cancel(self.id));
    }

    /// Blocks until the request ends and answers its whole output. With an engine driven step
    /// by step on this thread, call it only after the request ended (e.g. after
    /// [`Engine::run_until_idle`]), or it waits forever.
    pub fn wait(self) -> Result<Completion, ServeError> {
        let mut tokens = Vec::new();
        loop {
            match self.events.recv() {
                Ok(Event::Token(token)) => tokens.push(token),
                Ok(Event::Finished {
                    reason,
                    usage,
                    logits_digest,
                }) => {
                    return Ok(Completion {
                        tokens,
                        reason,
                        usage,
                        logits_digest,
                    })
                }
                Ok(Event::Error(err)) => return Err(err),
                Err(_) => return Err(ServeError::EngineStopped),
            }
        }
    }
}

/// The engine's door for new requests: open until a shutdown begins, then closed for good.
///
/// A client holds the read lock while it checks the door and queues its submission, and closing
/// takes the write lock; so once [`Intake::close`] returns, every submission that got through is
/// in the command channel (where the engine's next drain finds it and answers it with a final
/// event), and every later one is refused at `submit`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Intake {
    closed: Arc<RwLock<bool>>,
}

impl Intake {
    /// Closes the door; waits for submissions already past it to finish queueing.
    pub(crate) fn close(&self) {
        *self.closed.write().unwrap_or_else(PoisonError::into_inner) = true;
    }

    /// Runs `queue` unless the door is closed (then answers `EngineStopped`).
    fn admit<T>(&self, queue: impl FnOnce() -> Result<T, RequestError>) -> Result<T, RequestError> {
        let closed = self.closed.read().unwrap_or_else(PoisonError::into_inner);
        if *closed {
            return Err(RequestError::EngineStopped);
        }
        queue()
    }
}

/// A cloneable, `Send` client of an engine: submits requests, and nothing else.
#[derive(Debug, Clone)]
pub struct EngineClient {
    commands: Sender<Command>,
    limits: Arc<Limits>,
    next_id: Arc<AtomicU64>,
    intake: Intake,
}

impl EngineClient {
    pub(crate) fn new(
        commands: Sender<Command>,
        limits: Arc<Limits>,
        next_id: Arc<AtomicU64>,
        intake: Intake,
    ) -> Self {
        EngineClient {
            commands,
            limits,
            next_id,
            intake,
        }
    }

    /// What requests are checked against.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Validates `request` here (so a bad one is refused at once) and hands it to the engine.
    ///
    /// Once a shutdown has begun the request is refused with [`RequestError::EngineStopped`];
    /// a request accepted here always gets exactly one final event, even when a shutdown
    /// starts right after (then [`ServeError::EngineStopped`], unless it was already running).
    pub fn submit(&self, request: Request) -> Result<RequestHandle, RequestError> {
        self.limits.validate(&request)?;
        self.intake.admit(|| {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (events_tx, events) = crossbeam_channel::unbounded();
            let tracked = Tracked::new(id, request, events_tx);
            self.commands
                .send(Command::Submit(Box::new(tracked)))
                .map_err(|_| RequestError::EngineStopped)?;
            Ok(RequestHandle::new(id, events, self.commands.clone()))
        })
    }
}

impl EngineClient {
    /// A snapshot of the engine and its router (facts, counters, queue lengths), answered by
    /// the engine between two steps (at once when it is idle). With an engine driven step by
    /// step on this thread, call [`Engine::stats`] instead: this waits for the next step.
    pub fn stats(&self) -> Result<EngineStats, ControlError> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.commands
            .send(Command::Stats(answer))
            .map_err(|_| ControlError::EngineStopped)?;
        answered.recv().map_err(|_| ControlError::EngineStopped)
    }

    /// Drops every cached prefix that no running request holds (vLLM's `reset_prefix_cache`),
    /// between two steps of the engine; answers once it is done.
    pub fn clear_prefix_cache(&self) -> Result<(), ControlError> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.commands
            .send(Command::ClearPrefixCache(answer))
            .map_err(|_| ControlError::EngineStopped)?;
        Ok(answered.recv().map_err(|_| ControlError::EngineStopped)??)
    }

    /// Subscribes to the prefix cache's events with the default backlog (see
    /// [`crate::cache_events`]): the stream starts with the blocks cached now and goes on with
    /// every change; it ends when the engine stops, or when this subscriber falls a backlog
    /// behind (then subscribe again). Answered between two steps of the engine. A router without
    /// cache events answers [`ControlError::Router`] with `DeviceError::Unsupported`.
    pub fn subscribe_cache_events(&self) -> Result<Receiver<CacheEvent>, ControlError> {
        self.subscribe(None)
    }

    /// [`EngineClient::subscribe_cache_events`] with room for `backlog` unreceived events.
    pub fn subscribe_cache_events_with_backlog(
        &self,
        backlog: NonZeroUsize,
    ) -> Result<Receiver<CacheEvent>, ControlError> {
        self.subscribe(Some(backlog))
    }

    fn subscribe(
        &self,
        backlog: Option<NonZeroUsize>,
    ) -> Result<Receiver<CacheEvent>, ControlError> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.commands
            .send(Command::SubscribeCacheEvents { backlog, answer })
            .map_err(|_| ControlError::EngineStopped)?;
        Ok(answered.recv().map_err(|_| ControlError::EngineStopped)??)
    }

    /// Loads, unloads or lists LoRA adapters. The engine applies the command at its next
    /// quiescent point (between steps with no step in flight; at depth 2 it drains first) and
    /// answers once it is applied: the router's ack, or the typed reason it was refused (an
    /// unload while an unfinished request names the adapter is [`LoraError::InUse`]). A loaded
    /// adapter may be named by requests submitted after the answer. With an engine driven step
    /// by step on this thread, call [`Engine::lora`] instead: this waits for the next step.
    pub fn lora(&self, cmd: LoraCommand) -> Result<LoraAck, ControlError> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.commands
            .send(Command::Lora(cmd, answer))
            .map_err(|_| ControlError::EngineStopped)?;
        answered.recv().map_err(|_| ControlError::EngineStopped)?
    }
}

/// An engine running on its own thread. Dropping it aborts and joins the thread; call
/// [`EngineThread::shutdown`] to choose the mode and see the result.
#[derive(Debug)]
pub struct EngineThread {
    client: EngineClient,
    join: Option<JoinHandle<Result<Metrics, EngineError>>>,
}

impl EngineThread {
    /// Moves `engine` to a new thread named `engine` that serves until shutdown.
    pub fn spawn<D>(engine: Engine<D>) -> std::io::Result<Self>
    where
        D: DeviceIo + 'static,
        D::Seq: Sequence + 'static,
    {
        let client = engine.client();
        let join = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || engine.run())?;
        Ok(EngineThread {
            client,
            join: Some(join),
        })
    }

    /// A client of the engine.
    pub fn client(&self) -> EngineClient {
        self.client.clone()
    }

    /// Shuts the engine down in `mode`, waits for its thread, and answers its final counters.
    pub fn shutdown(mut self, mode: ShutdownMode) -> Result<Metrics, EngineError> {
        self.stop(mode)
    }

    fn stop(&mut self, mode: ShutdownMode) -> Result<Metrics, EngineError> {
        let Some(join) = self.join.take() else {
            return Err(EngineError::ThreadPanicked);
        };
        // New submissions are refused from here on; those already queued get a final event.
        self.client.intake.close();
        // A closed channel means the thread already ended; joining tells how.
        let _ = self.client.commands.send(Command::Shutdown(mode));
        join.join().map_err(|_| EngineError::ThreadPanicked)?
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        if self.join.is_some() {
            if let Err(err) = self.stop(ShutdownMode::Abort) {
                tracing::error!(%err, "engine shutdown on drop failed");
            }
        }
    }
}
