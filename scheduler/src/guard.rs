//! `Guarded<D>`: the engine's handle on its router. It keeps a panic inside any router call from
//! unwinding into the engine (the call answers `DeviceError::DeviceLost` instead), and it
//! remembers the first loss, so that once the device is lost no call reaches the router again
//! except its teardown.
//!
//! Invariant: `lost` is set exactly when some call answered `DeviceLost` (or panicked); from then
//! on every call answers that error without touching the router.

use std::any::Any;
use std::cell::OnceCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use device_io::{DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, StepPlan, StepResult};
use device_io::{LoraAck, LoraCommand, LoraError, Result, Ticket};

/// See the module docs.
pub(crate) struct Guarded<D> {
    router: Box<D>,
    lost: OnceCell<DeviceError>,
}

impl<D: std::fmt::Debug> std::fmt::Debug for Guarded<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("router", &self.router)
            .field("lost", &self.lost.get())
            .finish()
    }
}

/// What a panic payload says (a `&str` or `String` message, or nothing readable).
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

impl<D: DeviceIo> Guarded<D> {
    pub(crate) fn new(router: D) -> Self {
        Guarded {
            router: Box::new(router),
            lost: OnceCell::new(),
        }
    }

    /// The router itself (for inspection; calls through it are not guarded).
    pub(crate) fn inner(&self) -> &D {
        &self.router
    }

    /// The error that lost the device, once one did.
    pub(crate) fn lost(&self) -> Option<&DeviceError> {
        self.lost.get()
    }

    fn call<T>(&self, what: &'static str, f: impl FnOnce(&D) -> Result<T>) -> Result<T> {
        if let Some(err) = self.lost.get() {
            return Err(err.clone());
        }
        // A router that panicked is never called again (but for its teardown), so whatever state
        // the unwind left it in is not observed.
        let result = match catch_unwind(AssertUnwindSafe(|| f(&self.router))) {
            Ok(result) => result,
            Err(payload) => Err(DeviceError::DeviceLost(format!(
                "the router panicked during {what}: {}",
                panic_message(payload.as_ref())
            ))),
        };
        if let Err(err @ DeviceError::DeviceLost(_)) = &result {
            tracing::error!(during = what, %err, "the device is lost; failing every request");
            let _ = self.lost.set(err.clone());
        }
        result
    }

    pub(crate) fn facts(&self) -> DeviceFacts {
        self.call("facts", |router| Ok(router.facts()))
            .unwrap_or_default()
    }

    pub(crate) fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut D::Seq]) -> Result<Ticket> {
        self.call("launch", |router| router.launch(plan, rows))
    }

    pub(crate) fn await_result(&self, ticket: Ticket) -> Result<StepResult<D::Ptr>> {
        self.call("await_result", |router| router.await_result(ticket))
    }

    pub(crate) fn apply(&self, effect: Effect<'_, D::Seq, D::Ptr>) -> Result<EffectOutcome> {
        self.call(effect.name(), |router| router.apply(effect))
    }

    pub(crate) fn clear_prefix_cache(&self) -> Result<()> {
        self.call("clear_prefix_cache", |router| router.clear_prefix_cache())
    }

    pub(crate) fn subscribe_cache_events(
        &self,
        sink: Box<dyn device_io::CacheEventSink>,
    ) -> Result<()> {
        self.call("subscribe_cache_events", |router| {
            router.subscribe_cache_events(sink)
        })
    }

    /// A LoRA command (the caller made sure no step is in flight). A router that panics or
    /// answers `DeviceLost` loses the device, as in any other call.
    pub(crate) fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<LoraAck, LoraError>
    where
        D::LoraCmd: From<LoraCommand>,
        D::LoraAck: Into<LoraAck>,
    {
        if let Some(err) = self.lost.get() {
            return Err(LoraError::DeviceLost(err.to_string()));
        }
        let router = &mut self.router;
        let result = match catch_unwind(AssertUnwindSafe(|| router.lora(cmd.into()))) {
            Ok(result) => result.map(Into::into),
            Err(payload) => Err(LoraError::DeviceLost(format!(
                "the router panicked during lora: {}",
                panic_message(payload.as_ref())
            ))),
        };
        if let Err(LoraError::DeviceLost(message)) = &result {
            let err = DeviceError::DeviceLost(message.clone());
            tracing::error!(during = "lora", %err, "the device is lost; failing every request");
            let _ = self.lost.set(err);
        }
        result
    }

    /// Tears the router down; a panic there is an error like any other.
    pub(crate) fn teardown(self) -> Result<()> {
        let router = self.router;
        catch_unwind(AssertUnwindSafe(|| router.teardown())).unwrap_or_else(|payload| {
            Err(DeviceError::DeviceLost(format!(
                "the router panicked during teardown: {}",
                panic_message(payload.as_ref())
            )))
        })
    }
}
