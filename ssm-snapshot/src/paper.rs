//! A faithful model of the Marconi artifact's simulator (the paper's own Python radix cache), used
//! as a REFERENCE to score our policies against; it is not a cache a router should use.
//!
//! The artifact's semantics differ from [`crate::store`] on purpose, and this module keeps every
//! difference, quirks included:
//!
//! - **Tree.** A radix tree over token ids, token granularity (block size 1). Every non-root node
//!   holds exactly one SSM state (the state after its last token) plus the KV of its edge tokens,
//!   so the cache holds `nodes · C + edge tokens · K` bytes (`C` = [`CostModel::checkpoint_bytes`],
//!   `K` = [`CostModel::kv_bytes_per_token`]).
//! - **Clock.** A logical clock `now` advances by one at the start of every prefix match (the
//!   request's lookup and the match an insert does internally), of every insert and of every
//!   eviction call. Recency is hyperbolic: `1 / (now - ts)`.
//! - **Match.** The walk takes the child whose edge starts with the next key token. A fully
//!   matched child is *appended* (its tokens count as hit) and the walk continues below it. A
//!   partially matched child (common prefix `p` shorter than its edge) is not appended, but the
//!   walk still continues at that child with `key[p..]` (the artifact's quirk: it may then append
//!   children of that node, counting tokens that are not a prefix of the key as hits;
//!   [`PaperStats::quirk_appends`] and [`PaperStats::quirk_hit_tokens`] count it). The match
//!   returns the hit tokens (sum of appended edges) and `prefix_len` (sum of every `p`).
//!   [`PaperVersion::SglangPlus`] stamps every node the walk visits (root included) with `now`;
//!   the Marconi versions stamp only the last appended node.
//! - **Insert.** `now += 1`, the bootstrap check ([`PaperVersion::Marconi`]), an internal match,
//!   then an eviction of `size + needed - capacity` bytes if `size + needed > capacity`, with
//!   `needed = (2 if prefix_len > hit else 1) · C + K · (len - prefix_len)`. Then the tokens are
//!   inserted: a partially matched child is split at `p` (a new node with the first `p` tokens
//!   and a branch state becomes the old child's parent), and the rest becomes a new leaf. New
//!   nodes get `ts = now`; SGLang+ also stamps every existing node the insert walk enters.
//!   Children keep insertion order; a split or merge takes the replaced child's place.
//! - **No pinning, checked only before inserting.** Eviction may remove the path of the very
//!   sequence being inserted, which the insert then adds back in full, so the cache can end above
//!   its capacity; [`PaperCache::max_bytes`] reports the overshoot instead of failing on it.
//! - **Eviction, SGLang+.** A min-heap of the leaves keyed by `ts`, built from them in the tree's
//!   DFS pre-order (children in order); pop, delete, and push the parent (not the root) when it
//!   has become a leaf, until enough bytes are freed or nothing is left. Equal timestamps are
//!   common (a split stamps the branch node, the old child and the new leaf alike); the artifact
//!   breaks those ties by where Python's `heapq` happens to place them, and so does this model
//!   (it runs the same heap algorithm), which changes hit rates by up to ~0.1 point against a
//!   DFS-order tie-break.
//! - **Eviction, Marconi.** Until enough bytes are freed: score every non-root node with at most
//!   one child by `α · eff + recency`, each min-max normalised over the candidates (all 1.0 when
//!   they are all equal), where `eff = F / (C + K · depth)` and `F` is the node's marginal prefix
//!   FLOPs (`flops(depth) - flops(depth - edge)`: Mamba and MLP FLOPs are linear in tokens, so
//!   this equals the artifact's per-layer-kind sum; it is computed without subtracting rounded
//!   totals, see `PaperCache::empty`). The first minimum in DFS pre-order goes: a
//!   leaf frees `C + K · edge` and is deleted; a single-child node frees only `C` and merges with
//!   its child (edge concatenated, `ts` the later of the two, the child's children).
//! - **Bootstrap tuning** ([`PaperVersion::Marconi`] only, once). At the first eviction (any
//!   version) the cache records how many lookups it has seen, `n`, and sets the window
//!   `W = bootstrap_multiplier · n`. At the insert where the lookup count equals `W`, every call
//!   seen so far (the current insert included) is replayed from an empty tree under
//!   [`PaperVersion::FixedAlpha`] for each α in `{0, 0.1, …, 2.0}`, and the α whose replay saved
//!   the most FLOPs (first maximum) is kept. Before that, α = 0.
//!
//! Invariants of [`PaperCache`]: the root is node 0, has an empty edge and depth 0; every other
//! live node has a non-empty edge, `depth = parent depth + edge length`, and its first token is
//! unique among its siblings; `node_count` and `token_count` are the live non-root nodes and
//! the sum of their edge lengths; freed arena slots are on the free list and reachable from no
//! node. The recorded call history (every lookup and insert, for the replay) is non-empty only
//! for [`PaperVersion::Marconi`] before the bootstrap replay and while the window can still be
//! reached.

use crate::cost::CostModel;
use crate::error::SnapshotError;
use crate::sim::{RequestOutcome, SimReport};

/// Which of the artifact's eviction policies the cache runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PaperVersion {
    /// The artifact's "V1" (SGLang+): LRU over leaves, every visited node stamped.
    SglangPlus,
    /// The artifact's "V2" (Marconi): utility eviction, α = 0 until the bootstrap replay tunes it.
    Marconi,
    /// The artifact's "V3": Marconi's eviction with this fixed α and no tuning.
    FixedAlpha(f64),
}

/// The α values the bootstrap replay tries: `i / 10` for `i` in `0..=20`.
pub fn bootstrap_grid() -> Vec<f64> {
    (0..=20).map(|i| f64::from(i) / 10.0).collect()
}

/// Settings of a [`PaperCache`].
#[derive(Debug, Clone, PartialEq)]
pub struct PaperConfig {
    /// The eviction policy.
    pub version: PaperVersion,
    /// The byte budget checked before each insert (it can be overshot; see the module docs).
    pub capacity_bytes: u64,
    /// Tokens per block: the artifact works per token, so only 1 is accepted.
    pub block_size: u32,
    /// The model's costs.
    pub cost: CostModel,
    /// `W = bootstrap_multiplier · (lookups before the first eviction)`.
    pub bootstrap_multiplier: u64,
}

impl PaperConfig {
    /// Block size 1 and the bootstrap multiplier of the artifact's logged runs (15).
    pub fn new(version: PaperVersion, capacity_bytes: u64, cost: CostModel) -> Self {
        Self {
            version,
            capacity_bytes,
            block_size: 1,
            cost,
            bootstrap_multiplier: 15,
        }
    }
}

/// Counters of a [`PaperCache`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PaperStats {
    /// Lookups (one per request).
    pub lookups: u64,
    /// Inserts.
    pub inserts: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens the lookups reported as hits.
    pub hit_tokens: u64,
    /// Lookups with a non-zero hit.
    pub hit_requests: u64,
    /// Prefix FLOPs of the hits.
    pub flops_saved: f64,
    /// Eviction calls.
    pub evictions: u64,
    /// Leaves deleted by eviction.
    pub evicted_leaves: u64,
    /// Single-child nodes merged into their child by eviction (Marconi versions).
    pub merged_nodes: u64,
    /// Nodes split by inserts (each split creates a branch node).
    pub splits: u64,
    /// Nodes appended by any match after a partial match on the same walk (the artifact quirk).
    pub quirk_appends: u64,
    /// Hit tokens of lookups that came from such appends.
    pub quirk_hit_tokens: u64,
}

/// The bootstrap replay's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct BootstrapTuning {
    /// Lookups seen when it ran (equals `window`).
    pub at_request: u64,
    /// The window `W`.
    pub window: u64,
    /// Calls replayed (lookups plus inserts).
    pub calls_replayed: usize,
    /// FLOPs each α of [`bootstrap_grid`] saved in the replay, in grid order.
    pub flops_saved: Vec<f64>,
    /// The chosen α (the first maximum).
    pub alpha: f64,
}

/// One node as [`PaperCache::nodes`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Tokens from the root to the node's end.
    pub depth: u64,
    /// The node's own tokens.
    pub edge: Vec<u32>,
    /// Last access time on the logical clock.
    pub ts: u64,
    /// Number of children.
    pub children: usize,
}

#[derive(Debug, Clone)]
enum Call {
    Lookup(Vec<u32>),
    Insert(Vec<u32>),
}

#[derive(Debug, Clone)]
struct Node {
    edge: Vec<u32>,
    parent: u32,
    children: Vec<u32>,
    ts: u64,
    depth: u64,
}

const ROOT: u32 = 0;

struct MatchOutcome {
    hit: u64,
    prefix_len: u64,
    quirk_hit: u64,
}

/// The artifact's radix cache (see the module docs for its exact semantics).
#[derive(Debug, Clone)]
pub struct PaperCache {
    config: PaperConfig,
    nodes: Vec<Node>,
    free: Vec<u32>,
    node_count: u64,
    token_count: u64,
    now: u64,
    alpha: f64,
    first_eviction_requests: Option<u64>,
    bootstrap_window: Option<u64>,
    tuning: Option<BootstrapTuning>,
    history: Vec<Call>,
    max_bytes: u64,
    stats: PaperStats,
    /// `flops(l) = flops_linear · l + flops_quadratic · l²`, read back from the cost model.
    flops_linear: f64,
    flops_quadratic: f64,
}

impl PaperCache {
    /// An empty cache. Rejects a block size other than 1 and a fixed α that is negative or not
    /// finite.
    pub fn new(config: PaperConfig) -> Result<Self, SnapshotError> {
        if config.block_size != 1 {
            return Err(SnapshotError::BadConfig {
                field: "block_size",
                value: config.block_size.to_string(),
                limit: "the paper's simulator works per token: block size must be 1",
            });
        }
        let alpha = match config.version {
            PaperVersion::FixedAlpha(alpha) => {
                if !alpha.is_finite() || alpha < 0.0 {
                    return Err(SnapshotError::BadConfig {
                        field: "alpha",
                        value: alpha.to_string(),
                        limit: "must be finite and non-negative",
                    });
                }
                alpha
            }
            PaperVersion::SglangPlus | PaperVersion::Marconi => 0.0,
        };
        Ok(Self::empty(config, alpha))
    }

    /// An empty cache with eviction weight `alpha` (the caller checked `config`).
    fn empty(config: PaperConfig, alpha: f64) -> Self {
        // Prefix FLOPs are `a·l + b·l²`; reading `a` and `b` back lets eviction compute a node's
        // marginal FLOPs as `a·edge + b·edge·(depth + parent depth)`, which is exact in f64 for
        // integer coefficients and realistic lengths (as the artifact's integer arithmetic is),
        // instead of subtracting two large, rounded prefix totals.
        let one = config.cost.prefix_flops(1);
        let flops_quadratic = (config.cost.prefix_flops(2) - 2.0 * one) / 2.0;
        let flops_linear = one - flops_quadratic;
        Self {
            flops_linear,
            flops_quadratic,
            config,
            nodes: vec![Node {
                edge: Vec::new(),
                parent: ROOT,
                children: Vec::new(),
                ts: 0,
                depth: 0,
            }],
            free: Vec::new(),
            node_count: 0,
            token_count: 0,
            now: 0,
            alpha,
            first_eviction_requests: None,
            bootstrap_window: None,
            tuning: None,
            history: Vec::new(),
            max_bytes: 0,
            stats: PaperStats::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &PaperConfig {
        &self.config
    }

    /// Bytes held now: `nodes · C + edge tokens · K`.
    pub fn bytes(&self) -> u64 {
        self.node_count
            .saturating_mul(self.config.cost.checkpoint_bytes())
            .saturating_add(
                self.token_count
                    .saturating_mul(self.config.cost.kv_bytes_per_token()),
            )
    }

    /// The most bytes held after any insert (may exceed the capacity).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Non-root nodes.
    pub fn node_count(&self) -> u64 {
        self.node_count
    }

    /// The logical clock.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The α eviction uses now (0 for SGLang+).
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Lookups seen at the first eviction, once it happened.
    pub fn first_eviction_requests(&self) -> Option<u64> {
        self.first_eviction_requests
    }

    /// The bootstrap window `W`, once the first eviction set it.
    pub fn bootstrap_window(&self) -> Option<u64> {
        self.bootstrap_window
    }

    /// The bootstrap replay's outcome, once it ran.
    pub fn tuning(&self) -> Option<&BootstrapTuning> {
        self.tuning.as_ref()
    }

    /// The counters.
    pub fn stats(&self) -> &PaperStats {
        &self.stats
    }

    /// Every non-root node in DFS pre-order (children in order).
    pub fn nodes(&self) -> Vec<NodeView> {
        self.preorder()
            .into_iter()
            .map(|id| {
                let node = &self.nodes[id as usize];
                NodeView {
                    depth: node.depth,
                    edge: node.edge.clone(),
                    ts: node.ts,
                    children: node.children.len(),
                }
            })
            .collect()
    }

    /// One request: `lookup(input)` then `insert(input ++ output)`.
    pub fn serve(&mut self, input: &[u32], output: &[u32]) -> RequestOutcome {
        let before = self.stats.flops_saved;
        let hit = self.lookup(input);
        let mut full = Vec::with_capacity(input.len() + output.len());
        full.extend_from_slice(input);
        full.extend_from_slice(output);
        self.insert(&full);
        RequestOutcome {
            input_tokens: input.len(),
            hit_tokens: hit as usize,
            flops_saved: self.stats.flops_saved - before,
        }
    }

    /// The request's prefix match; returns its hit tokens (the artifact's count, quirk included).
    pub fn lookup(&mut self, input: &[u32]) -> u64 {
        if self.records_history(self.stats.lookups + 1) {
            self.history.push(Call::Lookup(input.to_vec()));
        } else if !self.history.is_empty() {
            // The window has passed without the replay (see `records_history`).
            self.history = Vec::new();
        }
        let found = self.match_prefix(input);
        self.stats.lookups += 1;
        self.stats.input_tokens += input.len() as u64;
        self.stats.hit_tokens += found.hit;
        self.stats.hit_requests += u64::from(found.hit > 0);
        self.stats.quirk_hit_tokens += found.quirk_hit;
        self.stats.flops_saved += self.config.cost.prefix_flops(found.hit);
        found.hit
    }

    /// Inserts `tokens` (a request's input and output), evicting first if the artifact's size
    /// check asks for it.
    pub fn insert(&mut self, tokens: &[u32]) {
        self.now += 1;
        self.stats.inserts += 1;
        if self.records_history(self.stats.lookups) {
            self.history.push(Call::Insert(tokens.to_vec()));
            if self.bootstrap_window == Some(self.stats.lookups) {
                self.bootstrap();
            }
        }
        let found = self.match_prefix(tokens);
        let c = self.config.cost.checkpoint_bytes();
        let k = self.config.cost.kv_bytes_per_token();
        let states = if found.prefix_len > found.hit { 2 } else { 1 };
        let needed = states * c + k * (tokens.len() as u64).saturating_sub(found.prefix_len);
        let size = self.bytes();
        if size.saturating_add(needed) > self.config.capacity_bytes {
            self.evict(size + needed - self.config.capacity_bytes);
        }
        self.insert_walk(tokens);
        self.max_bytes = self.max_bytes.max(self.bytes());
    }

    /// The figures so far in the simulator's report format (block size 1).
    pub fn report(&self, policy: &str) -> SimReport {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        SimReport {
            policy: policy.to_owned(),
            capacity_bytes: self.config.capacity_bytes,
            block_size: 1,
            requests: self.stats.lookups,
            input_tokens: self.stats.input_tokens,
            hit_tokens: self.stats.hit_tokens,
            token_hit_rate: ratio(self.stats.hit_tokens, self.stats.input_tokens),
            request_hit_rate: ratio(self.stats.hit_requests, self.stats.lookups),
            flops_saved: self.stats.flops_saved,
            alpha: self.alpha,
            max_bytes: self.max_bytes,
        }
    }

    /// Whether calls made while `lookups` lookups have been seen can still be replayed: only for
    /// [`PaperVersion::Marconi`], before its replay, and not past a known window. The window
    /// check comes before the eviction that sets the window, so with a multiplier of 0 or 1 the
    /// replay never runs (as in the artifact), and nothing needs to be kept.
    fn records_history(&self, lookups: u64) -> bool {
        self.config.version == PaperVersion::Marconi
            && self.tuning.is_none()
            && self.bootstrap_window.is_none_or(|window| lookups <= window)
    }

    fn is_sglang(&self) -> bool {
        self.config.version == PaperVersion::SglangPlus
    }

    fn child_starting_with(&self, node: u32, token: u32) -> Option<u32> {
        self.nodes[node as usize]
            .children
            .iter()
            .copied()
            .find(|&child| self.nodes[child as usize].edge[0] == token)
    }

    fn match_prefix(&mut self, key: &[u32]) -> MatchOutcome {
        self.now += 1;
        let stamp_all = self.is_sglang();
        let mut outcome = MatchOutcome {
            hit: 0,
            prefix_len: 0,
            quirk_hit: 0,
        };
        let mut node = ROOT;
        let mut rest = key;
        let mut last_appended = None;
        let mut after_partial = false;
        loop {
            if stamp_all {
                self.nodes[node as usize].ts = self.now;
            }
            let Some(&first) = rest.first() else { break };
            let Some(child) = self.child_starting_with(node, first) else {
                break;
            };
            let edge = &self.nodes[child as usize].edge;
            let p = common_prefix(edge, rest);
            if p == edge.len() {
                outcome.hit += p as u64;
                last_appended = Some(child);
                if after_partial {
                    self.stats.quirk_appends += 1;
                    outcome.quirk_hit += p as u64;
                }
            } else {
                after_partial = true;
            }
            outcome.prefix_len += p as u64;
            rest = &rest[p..];
            node = child;
        }
        if !stamp_all {
            if let Some(last) = last_appended {
                self.nodes[last as usize].ts = self.now;
            }
        }
        outcome
    }

    fn insert_walk(&mut self, tokens: &[u32]) {
        let stamp_all = self.is_sglang();
        let mut node = ROOT;
        let mut rest = tokens;
        loop {
            if stamp_all {
                self.nodes[node as usize].ts = self.now;
            }
            let Some(&first) = rest.first() else { return };
            let Some(child) = self.child_starting_with(node, first) else {
                self.add_node(node, rest.to_vec());
                return;
            };
            let p = common_prefix(&self.nodes[child as usize].edge, rest);
            if p == self.nodes[child as usize].edge.len() {
                if p == rest.len() {
                    // Already cached; the artifact returns without entering the child.
                    return;
                }
            } else {
                node = self.split(child, p);
                rest = &rest[p..];
                continue;
            }
            rest = &rest[p..];
            node = child;
        }
    }

    /// Adds a leaf under `parent` with `ts = now`.
    fn add_node(&mut self, parent: u32, edge: Vec<u32>) -> u32 {
        let depth = self.nodes[parent as usize].depth + edge.len() as u64;
        self.token_count += edge.len() as u64;
        self.node_count += 1;
        let node = Node {
            edge,
            parent,
            children: Vec::new(),
            ts: self.now,
            depth,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.nodes[parent as usize].children.push(id);
        id
    }

    /// Splits `child` after its first `p` tokens; the new upper node takes its place.
    fn split(&mut self, child: u32, p: usize) -> u32 {
        let parent = self.nodes[child as usize].parent;
        let upper_edge: Vec<u32> = self.nodes[child as usize].edge.drain(..p).collect();
        let upper_depth = self.nodes[parent as usize].depth + p as u64;
        let upper = Node {
            edge: upper_edge,
            parent,
            children: vec![child],
            ts: self.now,
            depth: upper_depth,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = upper;
                id
            }
            None => {
                self.nodes.push(upper);
                (self.nodes.len() - 1) as u32
            }
        };
        self.nodes[child as usize].parent = id;
        let siblings = &mut self.nodes[parent as usize].children;
        if let Some(slot) = siblings.iter_mut().find(|c| **c == child) {
            *slot = id;
        }
        self.node_count += 1;
        self.stats.splits += 1;
        id
    }

    fn preorder(&self) -> Vec<u32> {
        let mut order = Vec::with_capacity(self.node_count as usize);
        let mut stack: Vec<u32> = self.nodes[ROOT as usize]
            .children
            .iter()
            .rev()
            .copied()
            .collect();
        while let Some(id) = stack.pop() {
            order.push(id);
            stack.extend(self.nodes[id as usize].children.iter().rev().copied());
        }
        order
    }

    /// Deletes a leaf; returns its parent.
    fn delete_leaf(&mut self, id: u32) -> u32 {
        let parent = self.nodes[id as usize].parent;
        let siblings = &mut self.nodes[parent as usize].children;
        if let Some(pos) = siblings.iter().position(|&c| c == id) {
            siblings.remove(pos);
        }
        let edge = std::mem::take(&mut self.nodes[id as usize].edge);
        self.token_count -= edge.len() as u64;
        self.node_count -= 1;
        self.free.push(id);
        self.stats.evicted_leaves += 1;
        parent
    }

    /// Merges a single-child node with its child; the merged node keeps `id`'s place.
    fn merge_with_child(&mut self, id: u32) {
        let child = self.nodes[id as usize].children[0];
        let child_node = std::mem::replace(
            &mut self.nodes[child as usize],
            Node {
                edge: Vec::new(),
                parent: ROOT,
                children: Vec::new(),
                ts: 0,
                depth: 0,
            },
        );
        for &grandchild in &child_node.children {
            self.nodes[grandchild as usize].parent = id;
        }
        let node = &mut self.nodes[id as usize];
        node.edge.extend_from_slice(&child_node.edge);
        node.ts = node.ts.max(child_node.ts);
        node.depth = child_node.depth;
        node.children = child_node.children;
        self.node_count -= 1;
        self.free.push(child);
        self.stats.merged_nodes += 1;
    }

    fn evict(&mut self, bytes_to_remove: u64) {
        self.now += 1;
        self.stats.evictions += 1;
        if self.first_eviction_requests.is_none() {
            let seen = self.stats.lookups;
            self.first_eviction_requests = Some(seen);
            self.bootstrap_window = Some(self.config.bootstrap_multiplier.saturating_mul(seen));
            tracing::debug!(
                requests = seen,
                window = self.config.bootstrap_multiplier.saturating_mul(seen),
                "first eviction sets the bootstrap window"
            );
        }
        if self.is_sglang() {
            self.evict_leaves_lru(bytes_to_remove);
        } else {
            self.evict_by_utility(bytes_to_remove);
        }
    }

    fn evict_leaves_lru(&mut self, bytes_to_remove: u64) {
        let c = self.config.cost.checkpoint_bytes();
        let k = self.config.cost.kv_bytes_per_token();
        let leaves: Vec<(u64, u32)> = self
            .preorder()
            .into_iter()
            .filter(|&id| self.nodes[id as usize].children.is_empty())
            .map(|id| (self.nodes[id as usize].ts, id))
            .collect();
        let mut heap = TimestampHeap::heapify(leaves);
        let mut freed = 0_u64;
        while freed < bytes_to_remove {
            let Some(id) = heap.pop() else {
                break;
            };
            freed += c + k * self.nodes[id as usize].edge.len() as u64;
            let parent = self.delete_leaf(id);
            if parent != ROOT && self.nodes[parent as usize].children.is_empty() {
                heap.push((self.nodes[parent as usize].ts, parent));
            }
        }
    }

    fn evict_by_utility(&mut self, bytes_to_remove: u64) {
        let c = self.config.cost.checkpoint_bytes();
        let k = self.config.cost.kv_bytes_per_token();
        let mut freed = 0_u64;
        let mut candidates = Vec::new();
        let mut efficiency = Vec::new();
        let mut recency = Vec::new();
        while freed < bytes_to_remove && self.node_count > 0 {
            candidates.clear();
            efficiency.clear();
            recency.clear();
            for id in self.preorder() {
                let node = &self.nodes[id as usize];
                if node.children.len() > 1 {
                    continue;
                }
                let parent_depth = node.depth - node.edge.len() as u64;
                let edge = node.edge.len() as f64;
                let flops = self.flops_linear * edge
                    + self.flops_quadratic * edge * (node.depth + parent_depth) as f64;
                let memory = c as f64 + k as f64 * node.depth as f64;
                candidates.push(id);
                efficiency.push(flops / memory);
                recency.push(1.0 / (self.now - node.ts) as f64);
            }
            normalise(&mut efficiency);
            normalise(&mut recency);
            let mut victim = 0;
            let mut best = f64::INFINITY;
            for (i, (eff, rec)) in efficiency.iter().zip(&recency).enumerate() {
                let utility = self.alpha * eff + rec;
                if utility < best {
                    best = utility;
                    victim = i;
                }
            }
            let id = candidates[victim];
            if self.nodes[id as usize].children.is_empty() {
                freed += c + k * self.nodes[id as usize].edge.len() as u64;
                self.delete_leaf(id);
            } else {
                freed += c;
                self.merge_with_child(id);
            }
        }
    }

    /// Marconi's bootstrap: replays every recorded call under each α of the grid from an empty
    /// tree and keeps the α that saved the most FLOPs (the first maximum).
    fn bootstrap(&mut self) {
        let history = std::mem::take(&mut self.history);
        let grid = bootstrap_grid();
        let mut flops_saved = Vec::with_capacity(grid.len());
        for &alpha in &grid {
            let mut config = self.config.clone();
            config.version = PaperVersion::FixedAlpha(alpha);
            // The grid's values are finite and non-negative and `new` checked the block size.
            let mut replay = PaperCache::empty(config, alpha);
            for call in &history {
                match call {
                    Call::Lookup(input) => {
                        replay.lookup(input);
                    }
                    Call::Insert(tokens) => replay.insert(tokens),
                }
            }
            flops_saved.push(replay.stats.flops_saved);
        }
        let mut chosen = 0;
        for (i, &saved) in flops_saved.iter().enumerate() {
            if saved > flops_saved[chosen] {
                chosen = i;
            }
        }
        self.alpha = grid[chosen];
        tracing::debug!(
            alpha = self.alpha,
            requests = self.stats.lookups,
            "bootstrap replay chose alpha"
        );
        self.tuning = Some(BootstrapTuning {
            at_request: self.stats.lookups,
            window: self.bootstrap_window.unwrap_or(self.stats.lookups),
            calls_replayed: history.len(),
            flops_saved,
            alpha: self.alpha,
        });
    }
}

/// A binary min-heap of `(ts, node)` compared by `ts` alone, laid out and sifted exactly as
/// CPython's `heapq` does (`heapify` sifts positions `len/2 - 1` down to 0; a sift from a
/// position first walks the smaller child (the right one unless the left is strictly smaller)
/// down to a leaf, then moves the item back up while it is strictly smaller than its parent).
/// The artifact heapifies its leaves in DFS order, so equal timestamps leave in the order this
/// layout gives, which is neither DFS order nor insertion order; keeping the same algorithm keeps
/// its tie-breaking.
struct TimestampHeap {
    items: Vec<(u64, u32)>,
}

impl TimestampHeap {
    fn heapify(items: Vec<(u64, u32)>) -> Self {
        let mut heap = Self { items };
        for pos in (0..heap.items.len() / 2).rev() {
            heap.sift_from(pos);
        }
        heap
    }

    fn push(&mut self, item: (u64, u32)) {
        self.items.push(item);
        self.sift_towards_root(0, self.items.len() - 1);
    }

    fn pop(&mut self) -> Option<u32> {
        let last = self.items.pop()?;
        if self.items.is_empty() {
            return Some(last.1);
        }
        let top = std::mem::replace(&mut self.items[0], last);
        self.sift_from(0);
        Some(top.1)
    }

    /// Moves the item at `pos` up while it is strictly older than its parent, not above `start`.
    fn sift_towards_root(&mut self, start: usize, mut pos: usize) {
        let item = self.items[pos];
        while pos > start {
            let parent = (pos - 1) / 2;
            if item.0 < self.items[parent].0 {
                self.items[pos] = self.items[parent];
                pos = parent;
            } else {
                break;
            }
        }
        self.items[pos] = item;
    }

    /// Walks the item at `pos` down to a leaf along the smaller children, then back up.
    fn sift_from(&mut self, start: usize) {
        let end = self.items.len();
        let item = self.items[start];
        let mut pos = start;
        let mut child = 2 * pos + 1;
        while child < end {
            let right = child + 1;
            if right < end && self.items[child].0 >= self.items[right].0 {
                child = right;
            }
            self.items[pos] = self.items[child];
            pos = child;
            child = 2 * pos + 1;
        }
        self.items[pos] = item;
        self.sift_towards_root(start, pos);
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Min-max normalisation; all 1.0 when every value is equal (or there is only one).
fn normalise(values: &mut [f64]) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.len() <= 1 || max == min {
        values.iter_mut().for_each(|v| *v = 1.0);
    } else {
        values
            .iter_mut()
            .for_each(|v| *v = (*v - min) / (max - min));
    }
}

#[cfg(test)]
mod tests {
    use super::TimestampHeap;

    fn drain(heap: &mut TimestampHeap) -> Vec<u32> {
        std::iter::from_fn(|| heap.pop()).collect()
    }

    /// The orders CPython's `heapq` gives for the same operations (checked with CPython 3 on
    /// objects compared by timestamp only).
    #[test]
    fn ties_leave_in_the_order_pythons_heapq_gives() {
        let mut heap = TimestampHeap::heapify((0..4).map(|id| (6, id)).collect());
        assert_eq!(drain(&mut heap), vec![2, 0, 3, 1]);

        let ts = [5, 6, 6, 5, 7, 6];
        let mut heap = TimestampHeap::heapify((0..6).map(|id| (ts[id as usize], id)).collect());
        let mut order = vec![heap.pop().unwrap(), heap.pop().unwrap()];
        heap.push((5, 6));
        heap.push((6, 7));
        order.extend(drain(&mut heap));
        assert_eq!(order, vec![3, 0, 6, 7, 5, 2, 1, 4]);
        assert_eq!(heap.pop(), None);
    }
}
