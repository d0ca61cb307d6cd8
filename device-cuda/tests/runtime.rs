//! `SimRuntime`'s own semantics: streams really overtake each other where no event orders them,
//! events really order them, pinned buffers wait for their copies, and bad ranges are typed errors.

use device_cuda::kernels;
use device_cuda::{CudaError, DType, Runtime, Schedule, SimRuntime, Stream};

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A kernel on the compute stream writes a buffer; the copy stream copies it. Under `CopyFirst`
/// the copy overtakes the kernel unless it waits on an event recorded after the kernel.
fn copy_after_kernel(schedule: Schedule, use_event: bool) -> Vec<u8> {
    let rt = SimRuntime::with_schedule(schedule).unwrap();
    let rows = 4;
    let dim = 64;
    let x = rt.alloc(rows * dim * 4).unwrap();
    let w = rt.alloc(dim * 4).unwrap();
    let out = rt.alloc(rows * dim * 4).unwrap();
    let copy = rt.alloc(rows * dim * 4).unwrap();
    rt.upload(x.all(), &f32_bytes(&vec![2.0; rows * dim]), Stream::Compute)
        .unwrap();
    rt.upload(w.all(), &f32_bytes(&vec![1.0; dim]), Stream::Compute)
        .unwrap();
    rt.sync_stream(Stream::Compute).unwrap();
    let event = rt.new_event().unwrap();
    rt.pause();
    kernels::rmsnorm(
        &rt,
        Stream::Compute,
        out.all(),
        x.all(),
        w.all(),
        DType::F32,
        rows,
        dim,
        0.0,
    )
    .unwrap();
    rt.record(&event, Stream::Compute).unwrap();
    if use_event {
        rt.wait_event(Stream::Copy, &event).unwrap();
    }
    rt.copy(copy.all(), out.all(), Stream::Copy).unwrap();
    rt.resume();
    rt.sync_stream(Stream::Copy).unwrap();
    rt.sync_event(&event).unwrap();
    assert!(rt.event_done(&event).unwrap());
    let mut bytes = vec![0u8; rows * dim * 4];
    rt.download(&mut bytes, copy.all(), Stream::Copy).unwrap();
    bytes
}

#[test]
fn events_order_streams_and_their_absence_shows() {
    let ones = f32_bytes(&vec![1.0; 4 * 64]);
    for schedule in [Schedule::Fifo, Schedule::ComputeFirst, Schedule::CopyFirst] {
        assert!(
            copy_after_kernel(schedule, true) == ones,
            "{schedule:?} with the event"
        );
    }
    // Without the event the copy stream overtakes the kernel and copies the zeros the kernel has
    // not overwritten yet: the streams are really concurrent.
    assert!(copy_after_kernel(Schedule::CopyFirst, false) == vec![0u8; 4 * 64 * 4]);
    assert!(copy_after_kernel(Schedule::Fifo, false) == ones);
}

#[test]
fn pinned_buffers_round_trip_through_both_streams() {
    for schedule in [Schedule::Fifo, Schedule::CopyFirst] {
        let rt = SimRuntime::with_schedule(schedule).unwrap();
        let device = rt.alloc(1000).unwrap();
        let pinned = rt.alloc_pinned(2000).unwrap();
        let data: Vec<u8> = (0..1000).map(|i| (i * 7 % 251) as u8).collect();
        rt.write_pinned(&pinned, 500, &data).unwrap();
        rt.copy_from_pinned(device.all(), &pinned, 500, Stream::Copy)
            .unwrap();
        rt.copy_to_pinned(&pinned, 1000, device.all(), Stream::Copy)
            .unwrap();
        let mut back = vec![0u8; 1000];
        rt.read_pinned(&pinned, 1000, &mut back).unwrap();
        assert_eq!(back, data);
        rt.free_pinned(pinned).unwrap();
        rt.free(device).unwrap();
    }
}

#[test]
fn bad_ranges_and_handles_are_typed_errors() {
    let rt = SimRuntime::new().unwrap();
    let a = rt.alloc(64).unwrap();
    let b = rt.alloc(32).unwrap();
    assert!(matches!(a.range(60, 8), Err(CudaError::BadRange(_))));
    assert!(matches!(
        rt.copy(a.range(0, 32).unwrap(), b.all(), Stream::Compute),
        Ok(())
    ));
    assert!(matches!(
        rt.copy(a.all(), b.all(), Stream::Compute),
        Err(CudaError::BadRange(_))
    ));
    assert!(matches!(
        rt.copy(
            a.range(0, 32).unwrap(),
            a.range(16, 32).unwrap(),
            Stream::Compute
        ),
        Err(CudaError::BadRange(_))
    ));
    assert!(matches!(
        rt.upload(b.all(), &[0u8; 3], Stream::Compute),
        Err(CudaError::BadRange(_))
    ));
    let stale = b.all();
    rt.free(b).unwrap();
    assert!(matches!(
        rt.memset(stale, 0, Stream::Compute),
        Err(CudaError::BadRange(_))
    ));
    let event = rt.new_event().unwrap();
    let id = format!("{event:?}");
    rt.destroy_event(event).unwrap();
    assert!(id.contains("id: 0"));
    // A wait on an event that was never recorded is a no-op, as in CUDA.
    let fresh = rt.new_event().unwrap();
    rt.wait_event(Stream::Copy, &fresh).unwrap();
    rt.sync_stream(Stream::Copy).unwrap();
    assert!(rt.event_done(&fresh).unwrap());
}

/// No GPU is needed for `CudaRuntime::new` to answer: on a machine without a driver it is a typed
/// error naming what is missing, never a panic.
#[test]
fn cuda_runtime_reports_a_missing_driver_as_an_error() {
    match device_cuda::CudaRuntime::new() {
        Ok(rt) => println!("a CUDA device is present: {}", rt.device_name()),
        Err(err) => {
            assert!(
                matches!(
                    err,
                    CudaError::NoDriver { .. }
                        | CudaError::NoDevice(_)
                        | CudaError::DriverTooOld { .. }
                ),
                "{err:?}"
            );
            println!("no CUDA device here: {err}");
        }
    }
}
