//! `Config::from_json_str` never panics: 10,000 mutated `config.json` texts (bytes flipped,
//! inserted, cut; fields replaced by arbitrary JSON: huge, negative, fractional, non-finite,
//! nested, wrong types) each give a config that validates, or a typed error.

use proptest::prelude::*;

/// The fixture's `config.json` as a JSON object (parsed once).
fn fixture_object() -> &'static serde_json::Map<String, serde_json::Value> {
    static OBJECT: std::sync::OnceLock<serde_json::Map<String, serde_json::Value>> =
        std::sync::OnceLock::new();
    OBJECT.get_or_init(|| {
        serde_json::from_str(include_str!("fixtures/nemotron-h-tiny/model/config.json")).unwrap()
    })
}

/// The fields the parser reads (and a few it ignores).
const FIELDS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "layers_block_type",
    "hybrid_override_pattern",
    "layer_norm_epsilon",
    "mamba_num_heads",
    "mamba_head_dim",
    "ssm_state_size",
    "n_groups",
    "conv_kernel",
    "time_step_min",
    "time_step_limit",
    "use_bias",
    "chunk_size",
    "mamba_hidden_act",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "mlp_hidden_act",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "moe_latent_size",
    "mtp_layers_block_type",
    "eos_token_id",
    "max_position_embeddings",
    "architectures",
];

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..70).prop_map(Value::from),
        Just(json!(1e300)),
        Just(json!(0.5)),
        Just(json!({"__float__": "Infinity"})),
        Just(json!({"__float__": "NaN"})),
        Just(json!({"__float__": "bogus"})),
        Just(json!(usize::MAX)),
        Just(json!(u64::MAX / 2 + 1)),
        "[MEm*\\-x]{0,12}".prop_map(Value::from),
        prop_oneof![
            Just("mamba"),
            Just("moe"),
            Just("mlp"),
            Just("attention"),
            Just("silu"),
            Just("relu2"),
            Just("gelu")
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(1, 6, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
            proptest::collection::vec(inner, 0..2).prop_map(|v| {
                let map: serde_json::Map<String, Value> = v
                    .into_iter()
                    .enumerate()
                    .map(|(i, x)| (format!("k{i}"), x))
                    .collect();
                Value::Object(map)
            }),
        ]
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    Byte(usize, u8),
    Cut(usize),
    Field(usize, serde_json::Value),
    Remove(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
        1 => any::<usize>().prop_map(Mutation::Cut),
        6 => (0..FIELDS.len(), json_value()).prop_map(|(i, v)| Mutation::Field(i, v)),
        2 => (0..FIELDS.len()).prop_map(Mutation::Remove),
    ]
}

/// The fixture with `mutations` applied: field edits on the object, then byte edits on its text.
fn mutated(mutations: &[Mutation]) -> String {
    let mut object = fixture_object().clone();
    for m in mutations {
        match m {
            Mutation::Field(i, value) => {
                object.insert(FIELDS[*i].to_string(), value.clone());
            }
            Mutation::Remove(i) => {
                object.remove(FIELDS[*i]);
            }
            Mutation::Byte(..) | Mutation::Cut(_) => {}
        }
    }
    let mut bytes = serde_json::Value::Object(object).to_string().into_bytes();
    for m in mutations {
        match m {
            Mutation::Byte(at, b) => {
                let len = bytes.len().max(1);
                if let Some(byte) = bytes.get_mut(at % len) {
                    *byte = *b;
                }
            }
            Mutation::Cut(at) => bytes.truncate(at % (bytes.len() + 1)),
            Mutation::Field(..) | Mutation::Remove(_) => {}
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_configs_parse_to_valid_configs_or_typed_errors(
        mutations in proptest::collection::vec(mutation(), 1..5),
    ) {
        let text = mutated(&mutations);
        if let Ok(config) = model::Config::from_json_str(&text) {
            // What parses is valid, and every size derived from it is computable.
            prop_assert!(config.validate().is_ok());
            let _ = (config.mamba_conv_dim(), config.mamba_in_proj_dim());
        }
    }
}
