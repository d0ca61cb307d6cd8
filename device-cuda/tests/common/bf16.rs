//! The host model with the matrices the device keeps in bf16 rounded to bf16: the reference that
//! bounds a bf16 device run. Shared by `device-cuda/tests/forward.rs` and, through a `#[path]`
//! module, `tests/tests/cuda_steps.rs` (the CUDA router's bf16 steps), so both bound their runs
//! by the same model.

use model::Model;

/// `model` with every GEMM matrix rounded to bf16 (the matrices the device keeps in bf16: every
/// 2-D weight but the MoE gate), written to a scratch folder and loaded back.
pub fn bf16_weights(model: &Model) -> Model {
    let dir = tempfile::tempdir().unwrap();
    model.save(dir.path()).unwrap();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        let mut values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if view.shape().len() == 2 && !name.ends_with(".gate.weight") {
            for v in &mut values {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap();
            (name.clone(), view)
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    Model::load(dir.path()).unwrap()
}
