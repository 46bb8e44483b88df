// plancache's route for torch's cuDNN attention: its steady path in C++ (plancache/client/sdpa_ext.py builds it).
//
// The Python route (plancache/client/sdpa.py) prepares each configuration: it writes the configuration's FE graph,
// keys it as a spec and takes its plan through the PlanCache ladder (verified: digest, signature, environment). It
// then hands the plan's serialized bytes here (add_forward / add_backward) with the tensors of that call, which
// key it. A later call of a configuration held here runs with no Python and no graph work: one hash lookup of the
// configuration (every size, stride, dtype and flag the plan was built for), outputs and workspace from torch's
// caching allocator on the current stream, one FE execute from a pointer array in the plan's own order. Every
// other call (a configuration not handed here yet, a mask the route converts, dropout under CUDA-graph capture, a
// debug mask, a nested batch, another device, an address not 16-byte aligned) calls the Python route's kernel,
// which decides as before; for a held configuration with a mask to convert, it converts it and calls serve_*.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;
namespace py = pybind11;

namespace {

constexpr int kMaxBuffers = 16;  // a forward binds 4 to 8 buffers, a backward 9 to 12
constexpr uintptr_t kAlignment = 16;
constexpr size_t kReplays = 4;      // captured launches kept per executor, by the addresses they bind
constexpr size_t kSeen = 8;         // addresses seen once per executor, waiting to be seen again
constexpr int kMaxCaptures = 32;    // per executor: addresses that keep changing are not worth capturing

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h ^= static_cast<size_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
  }
};

// The addresses one execute of a plan binds: its buffers in the plan's order, then the workspace (null where the
// plan takes none); the slots after them null.
using Addresses = std::array<void*, kMaxBuffers + 1>;

// A plan's launches captured as CUDA graphs, by the addresses they bind. cuDNN's execute spends tens of
// microseconds of host time a call (binding the variant pack, encoding the kernels' arguments), which bounds a
// step whose kernels are short; a call whose buffers and workspace sit at the addresses of an earlier call (a
// steady loop's: torch's caching allocator hands out the same blocks each step) replays the launches that
// execute made there instead: the same kernels and memsets with the same arguments, for one graph launch. The
// launches at a set of addresses are captured the second time they are seen (once is no pattern), from a private
// stream that runs nothing; never while the caller's stream is capturing (the caller's graph records the execute).
// A graph's launch waits on the host for its previous launch to finish, so a call whose graph is still queued
// executes instead (an event recorded after each launch says): the host never waits here, and a step bound by the
// GPU, where host time does not count, simply executes.
// Bounded: kReplays graphs per executor (the least recently replayed goes), kMaxCaptures captures; a capture that
// fails turns replays off for the executor, which executes as before.
struct Replays {
  struct Captured {
    Addresses at;
    cudaGraphExec_t exec;
    cudaEvent_t done;  // recorded after each launch
    uint64_t used;
  };
  std::mutex lock;
  std::vector<Captured> graphs;
  std::vector<Addresses> seen;
  size_t next_seen = 0;
  int captures = 0;
  bool off = false;
  uint64_t tick = 0;
  ~Replays() {
    for (auto& c : graphs) drop(c);
  }
  static void drop(Captured& c) {
    cudaGraphExecDestroy(c.exec);  // one in flight is freed when it completes
    cudaEventDestroy(c.done);
  }
};

// A loaded plan of one configuration and how to feed it.
struct Executor {
  std::shared_ptr<fe::graph::Graph> graph;
  std::vector<int> order;            // for each of the plan's variant-pack slots (FE's uid order): the call's buffer
  int64_t workspace = 0;
  std::vector<int64_t> out_strides;  // the forward's output layout (torch's meta kernel's); empty for the backward
  mutable Replays replays;
};

using Map = std::unordered_map<Key, std::shared_ptr<const Executor>, KeyHash>;
using Graphs = std::unordered_map<std::string, std::shared_ptr<fe::graph::Graph>>;

struct State {
  std::shared_mutex lock;  // readers: every call; writers: add_*, preload, install, uninstall
  Map forward, backward;
  Graphs preloaded;  // plans loaded ahead by graph key (a warm start's), for the configurations that will run them
  py::object py_forward, py_backward;  // the Python route's kernels: every call not served here
  int device = -1;
  std::unique_ptr<torch::Library> library;
  std::atomic<bool> replay{true};
  std::atomic<int64_t> served_forward{0}, served_backward{0};
  std::atomic<int64_t> replayed_forward{0}, replayed_backward{0}, captured{0}, capture_failed{0};
};

State& state() {
  static State* s = new State();  // never destroyed: a kernel may run while the interpreter exits
  return *s;
}

void push_tensor(Key& k, const at::Tensor& t) {
  k.push_back(t.dim());
  for (auto d : t.sizes()) k.push_back(d);
  for (auto d : t.strides()) k.push_back(d);
}

int64_t bits(double v) {
  int64_t out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

void push_flags(Key& k, const at::Tensor& q, bool causal, std::optional<double> scale, double p) {
  k.push_back(static_cast<int64_t>(q.scalar_type()));
  k.push_back(causal);
  k.push_back(scale.has_value());
  k.push_back(scale.has_value() ? bits(*scale) : 0);
  k.push_back(bits(p));
}

void push_bias(Key& k, const at::Tensor& bias) {
  k.push_back(bias.defined());
  if (bias.defined()) push_tensor(k, bias);
}

// A configuration's key: its direction (1 forward, 2 backward), the sizes and strides of its tensors (q, k, v and,
// for a backward, O and the log-sum-exp), its bias's, dtype and flags, and the direction's own flag (the forward's
// stats, the backward's deterministic setting).
Key config_key(int64_t direction, std::initializer_list<const at::Tensor*> tensors, const at::Tensor& bias,
               bool causal, std::optional<double> scale, double p, bool flag) {
  Key key;
  key.reserve(80);
  key.push_back(direction);
  for (auto* t : tensors) push_tensor(key, *t);
  push_bias(key, bias);
  push_flags(key, **tensors.begin(), causal, scale, p);
  key.push_back(flag);
  return key;
}

Key forward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias, bool stats,
                bool causal, std::optional<double> scale, double p) {
  return config_key(1, {&q, &k, &v}, bias, causal, scale, p, stats);
}

Key backward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                 const at::Tensor& lse, const at::Tensor& bias, bool causal, std::optional<double> scale, double p,
                 bool deterministic) {
  return config_key(2, {&q, &k, &v, &out, &lse}, bias, causal, scale, p, deterministic);
}

// torch's attn_bias as the route hands it to cuDNN (plancache.client.sdpa._bias) where that is a view of it: the
// broadcast head dim kept at size 1. Undefined where the route converts it (a boolean mask, another dtype, a
// batch, query or key dim broadcast, keys not innermost): the Python route converts it, then calls serve_*.
at::Tensor bias_view(const at::Tensor& bias, const at::Tensor& q, const at::Tensor& k) {
  if (bias.scalar_type() != q.scalar_type()) return {};
  auto e = bias.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
  for (int i : {0, 2, 3}) {
    if (e.stride(i) == 0 && e.size(i) > 1) return {};
  }
  if (e.stride(3) != 1) return {};
  return e.stride(1) == 0 ? e.narrow(1, 0, 1) : e;
}

// This thread's cuDNN handle on `device`, bound to the thread's current stream there.
cudnnHandle_t handle_for(int device) {
  struct Bound {
    cudnnHandle_t handle = nullptr;
    cudaStream_t stream = nullptr;
  };
  thread_local std::unordered_map<int, Bound> handles;
  auto& b = handles[device];
  if (b.handle == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    TORCH_CHECK(cudnnCreate(&b.handle) == CUDNN_STATUS_SUCCESS, "plancache: cudnnCreate failed");
    b.stream = nullptr;
    TORCH_CHECK(cudnnSetStream(b.handle, nullptr) == CUDNN_STATUS_SUCCESS, "plancache: cudnnSetStream failed");
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  if (stream != b.stream) {
    TORCH_CHECK(cudnnSetStream(b.handle, stream) == CUDNN_STATUS_SUCCESS, "plancache: cudnnSetStream failed");
    b.stream = stream;
  }
  return b.handle;
}

std::shared_ptr<const Executor> find(const Map& map, const Key& key) {
  std::shared_lock<std::shared_mutex> g(state().lock);
  auto it = map.find(key);
  return it == map.end() ? nullptr : it->second;
}

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The philox seed and offset a dropout forward hands cuDNN, drawn as the Python route draws them (sdpa._philox,
// torch's own cuDNN kernel's way): the device generator's seed and offset, the offset then advanced by one draw
// per element of the attention matrix; int64 scalars on the device (a 64-bit seed as the int64 of its bits).
std::pair<at::Tensor, at::Tensor> philox(const at::Tensor& q, const at::Tensor& k) {
  auto* impl = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.get_device()));
  uint64_t seed = 0, offset = 0;
  {
    std::lock_guard<std::mutex> lock(impl->mutex_);
    seed = impl->current_seed();
    offset = impl->get_offset();
    const uint64_t draws = static_cast<uint64_t>(q.size(0) * q.size(1) * q.size(2) * k.size(2));
    impl->set_offset(offset + (draws + 3) / 4 * 4);
  }
  auto options = q.options().dtype(at::kLong);
  return {at::full({}, static_cast<int64_t>(seed), options), at::full({}, static_cast<int64_t>(offset), options)};
}

// The tensors of a call in the order of the Python route's roles (plancache.client.sdpa: q, k, v, o, ...).
struct Buffers {
  const at::Tensor* t[kMaxBuffers];
  int n = 0;
  Buffers(std::initializer_list<const at::Tensor*> ts) {
    for (auto* x : ts) t[n++] = x;
  }
  void add(const at::Tensor& x) { t[n++] = &x; }
  // The optional roles after the fixed ones, in the Python route's order (sdpa._extra_roles): the bias, then
  // dropout's seed and offset.
  void add_extra(const at::Tensor& bias, double p, const at::Tensor& seed, const at::Tensor& offset) {
    if (bias.defined()) add(bias);
    if (p != 0.0) {
      add(seed);
      add(offset);
    }
  }
  bool aligned() const {
    uintptr_t any = 0;
    for (int i = 0; i < n; ++i) any |= reinterpret_cast<uintptr_t>(t[i]->data_ptr());
    return any % kAlignment == 0;
  }
};

// This thread's stream on `device` that captures a plan's launches (Replays); nothing runs on it.
cudaStream_t capture_stream(int device) {
  thread_local std::unordered_map<int, cudaStream_t> streams;
  auto& s = streams[device];
  if (s == nullptr) {
    TORCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess,
                "plancache: cudaStreamCreateWithFlags failed");
  }
  return s;
}

// The launches of one execute of `ex` at `at` (its `n` buffers, then the workspace), captured from `side` and
// instantiated; null where that failed (the CUDA error it left cleared).
cudaGraphExec_t capture(const Executor& ex, Addresses& at, int n, cudnnHandle_t handle, cudaStream_t stream,
                        cudaStream_t side) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool ok = cudnnSetStream(handle, side) == CUDNN_STATUS_SUCCESS &&
            cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (ok) {
    const bool executed = ex.graph->execute(handle, at.data(), n, at[n]).is_good();
    ok = cudaStreamEndCapture(side, &graph) == cudaSuccess && executed && graph != nullptr;
  }
  TORCH_CHECK(cudnnSetStream(handle, stream) == CUDNN_STATUS_SUCCESS, "plancache: cudnnSetStream failed");
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!ok) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    (void)cudaGetLastError();
    return nullptr;
  }
  return exec;
}

// One execute of `ex` at `at` (its `n` buffers, then the workspace) as a replay of launches captured there
// (captured now if `at` was seen before); false where the caller executes instead.
bool replay(const Executor& ex, Addresses& at, int n, cudnnHandle_t handle, cudaStream_t stream, int device,
            std::atomic<int64_t>& replayed) {
  auto& r = ex.replays;
  std::lock_guard<std::mutex> g(r.lock);
  auto launched = [&](Replays::Captured& c) {
    if (cudaGraphLaunch(c.exec, stream) == cudaSuccess && cudaEventRecord(c.done, stream) == cudaSuccess) {
      replayed.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    (void)cudaGetLastError();
    r.off = true;
    state().capture_failed.fetch_add(1, std::memory_order_relaxed);
    return false;
  };
  if (r.off) return false;
  ++r.tick;
  for (auto& c : r.graphs) {
    if (c.at == at) {
      c.used = r.tick;
      if (cudaEventQuery(c.done) == cudaErrorNotReady) {  // its previous launch is still queued: launching would wait
        (void)cudaGetLastError();
        return false;
      }
      return launched(c);
    }
  }
  auto seen = std::find(r.seen.begin(), r.seen.end(), at);
  if (seen == r.seen.end()) {
    if (r.seen.size() < kSeen) {
      r.seen.push_back(at);
    } else {
      r.seen[r.next_seen] = at;
      r.next_seen = (r.next_seen + 1) % kSeen;
    }
    return false;
  }
  if (r.captures >= kMaxCaptures) return false;
  ++r.captures;
  cudaGraphExec_t exec = capture(ex, at, n, handle, stream, capture_stream(device));
  cudaEvent_t done = nullptr;
  if (exec != nullptr && cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaGraphExecDestroy(exec);
    exec = nullptr;
  }
  if (exec == nullptr) {
    r.off = true;
    state().capture_failed.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  state().captured.fetch_add(1, std::memory_order_relaxed);
  *seen = Addresses{};  // no longer waiting
  if (r.graphs.size() == kReplays) {
    auto lru = std::min_element(r.graphs.begin(), r.graphs.end(),
                                [](const auto& a, const auto& b) { return a.used < b.used; });
    Replays::drop(*lru);
    r.graphs.erase(lru);
  }
  r.graphs.push_back({at, exec, done, r.tick});
  return launched(r.graphs.back());
}

// One execute of `ex` on the call's buffers (a replay where it can be: Replays), counted in `replayed` if replayed.
void run(const Executor& ex, const Buffers& buffers, int device, const at::TensorOptions& options,
         std::atomic<int64_t>& replayed) {
  TORCH_CHECK(buffers.n == static_cast<int>(ex.order.size()), "plancache: ", buffers.n,
              " buffers for a plan that binds ", ex.order.size());
  const int n = buffers.n;
  Addresses at{};
  for (int i = 0; i < n; ++i) at[i] = buffers.t[ex.order[i]]->data_ptr();
  // a plan that takes no workspace is handed none (FE accepts null there): one allocation less a call
  at::Tensor workspace;
  if (ex.workspace > 0) workspace = at::empty({ex.workspace}, options.dtype(at::kByte));
  at[n] = workspace.defined() ? workspace.data_ptr() : nullptr;
  cudnnHandle_t handle = handle_for(device);
  if (state().replay.load(std::memory_order_relaxed) && !capturing()) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (replay(ex, at, n, handle, stream, device, replayed)) return;
  }
  auto status = ex.graph->execute(handle, at.data(), n, at[n]);
  TORCH_CHECK(status.is_good(), "plancache: FE execute failed: ", status.get_message());
}

using FwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
                          at::Tensor, at::Tensor>;
using BwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor or_undefined(const py::handle& h) { return h.is_none() ? at::Tensor() : h.cast<at::Tensor>(); }

py::object or_none(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

FwdOut python_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& bias, bool stats, double p, bool causal, bool debug,
                      std::optional<double> scale) {
  py::gil_scoped_acquire gil;
  py::object b = bias.has_value() ? py::cast(*bias) : py::none();
  py::object s = scale.has_value() ? py::cast(*scale) : py::none();
  py::tuple r = state().py_forward(q, k, v, b, stats, p, causal, debug, py::arg("scale") = s);
  return {or_undefined(r[0]), or_undefined(r[1]), or_undefined(r[2]), or_undefined(r[3]),
          c10::SymInt(r[4].cast<int64_t>()), c10::SymInt(r[5].cast<int64_t>()), or_undefined(r[6]),
          or_undefined(r[7]), or_undefined(r[8])};
}

// A forward without dropout or debug mask whose configuration is held here, run; else nothing. ``bias``: the
// route's view of the attention bias (bias_view), or undefined.
std::optional<FwdOut> serve_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& bias, bool stats, bool causal, std::optional<double> scale,
                                    double p) {
  auto& st = state();
  Buffers inputs{&q, &k, &v};
  if (bias.defined()) inputs.add(bias);
  if (q.get_device() != st.device || !inputs.aligned()) return std::nullopt;
  auto ex = find(st.forward, forward_key(q, k, v, bias, stats, causal, scale, p));
  if (!ex) return std::nullopt;
  if (p != 0.0 && capturing()) return std::nullopt;  // a replay must draw anew: torch's own kernel does
  c10::cuda::CUDAGuard guard(st.device);  // cuDNN launches on the current device
  const auto b = q.size(0), h = q.size(1), s = q.size(2);
  auto out = at::empty_strided({b, h, s, v.size(3)}, ex->out_strides, q.options());
  auto lse = at::empty({b, h, s, 1}, q.options().dtype(at::kFloat));
  // the philox seed and offset: drawn for dropout; else unread, as torch's own kernel returns them
  auto [seed, offset] = p != 0.0 ? philox(q, k)
                                 : std::pair{at::empty({}, q.options().dtype(at::kLong)),
                                             at::empty({}, q.options().dtype(at::kLong))};
  Buffers buffers{&q, &k, &v, &out};
  if (stats) buffers.add(lse);
  buffers.add_extra(bias, p, seed, offset);
  run(*ex, buffers, st.device, q.options(), st.replayed_forward);
  st.served_forward.fetch_add(1, std::memory_order_relaxed);
  return FwdOut{out, lse, at::Tensor(), at::Tensor(), c10::SymInt(s), c10::SymInt(k.size(2)), seed, offset,
                at::Tensor()};
}

// aten::_scaled_dot_product_cudnn_attention's CUDA kernel.
FwdOut forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& bias,
               bool stats, double p, bool causal, bool debug, std::optional<double> scale) {
  if (!debug) {
    const at::Tensor view = bias.has_value() ? bias_view(*bias, q, k) : at::Tensor();
    if (!bias.has_value() || view.defined()) {
      if (auto served = serve_forward(q, k, v, view, stats, causal, scale, p)) return *std::move(served);
    }
  }
  return python_forward(q, k, v, bias, stats, p, causal, debug, scale);
}

BwdOut python_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse, const at::Tensor& seed,
                       const at::Tensor& offset, const at::Tensor& bias, const at::Tensor& cum_q,
                       const at::Tensor& cum_k, c10::SymInt max_q, c10::SymInt max_k, double p, bool causal,
                       std::optional<double> scale) {
  py::gil_scoped_acquire gil;
  py::object s = scale.has_value() ? py::cast(*scale) : py::none();
  py::tuple r = state().py_backward(dout, q, k, v, out, lse, or_none(seed), or_none(offset), or_none(bias),
                                    or_none(cum_q), or_none(cum_k), max_q.guard_int(__FILE__, __LINE__),
                                    max_k.guard_int(__FILE__, __LINE__), p, causal, py::arg("scale") = s);
  return {r[0].cast<at::Tensor>(), r[1].cast<at::Tensor>(), r[2].cast<at::Tensor>()};
}

// A backward without dropout or nested batch whose configuration is held here, run; else nothing. ``bias``: the
// route's view of the attention bias (bias_view), or undefined.
std::optional<BwdOut> serve_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& logsumexp,
                                     const at::Tensor& bias, bool causal, std::optional<double> scale, double p,
                                     const at::Tensor& seed, const at::Tensor& offset) {
  auto& st = state();
  if (q.get_device() != st.device) return std::nullopt;
  if (p != 0.0 && !(seed.defined() && offset.defined() && seed.get_device() == st.device &&
                    offset.get_device() == st.device)) {
    return std::nullopt;  // not what a cuDNN forward returns: torch's own kernel
  }
  const at::Tensor lse = logsumexp.dim() == 4 ? logsumexp : logsumexp.unsqueeze(-1);
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  auto ex = find(st.backward, backward_key(q, k, v, out, lse, bias, causal, scale, p, deterministic));
  if (!ex) return std::nullopt;
  at::Tensor d = dout;
  if (dout.strides() != out.strides()) {  // cuDNN reads dO in O's layout
    d = at::empty_strided(out.sizes(), out.strides(), out.options()).copy_(dout);
  }
  Buffers inputs{&q, &k, &v, &out, &d, &lse};
  if (bias.defined()) inputs.add(bias);
  if (!inputs.aligned()) return std::nullopt;
  c10::cuda::CUDAGuard guard(st.device);  // cuDNN launches on the current device
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  Buffers buffers{&q, &k, &v, &out, &d, &lse, &dq, &dk, &dv};
  buffers.add_extra(bias, p, seed, offset);
  run(*ex, buffers, st.device, q.options(), st.replayed_backward);
  st.served_backward.fetch_add(1, std::memory_order_relaxed);
  return BwdOut{dq, dk, dv};
}

// aten::_scaled_dot_product_cudnn_attention_backward's CUDA kernel.
BwdOut backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& seed,
                const at::Tensor& offset, const at::Tensor& bias, const at::Tensor& cum_q, const at::Tensor& cum_k,
                c10::SymInt max_q, c10::SymInt max_k, double p, bool causal, std::optional<double> scale) {
  if (!cum_q.defined()) {
    const at::Tensor view = bias.defined() ? bias_view(bias, q, k) : at::Tensor();
    if (!bias.defined() || view.defined()) {
      if (auto served = serve_backward(dout, q, k, v, out, logsumexp, view, causal, scale, p, seed, offset)) {
        return *std::move(served);
      }
    }
  }
  return python_backward(dout, q, k, v, out, logsumexp, seed, offset, bias, cum_q, cum_k, max_q, max_k, p, causal,
                         scale);
}

// A plan deserialized without FE's warm-up run, with the GIL released.
std::shared_ptr<fe::graph::Graph> deserialize(const py::bytes& blob) {
  std::string_view view = blob;
  std::vector<uint8_t> bytes(view.begin(), view.end());
  auto graph = std::make_shared<fe::graph::Graph>();
  const int device = state().device;
  py::gil_scoped_release nogil;
  c10::cuda::CUDAGuard guard(device);
  auto status = graph->deserialize(handle_for(device), bytes, false, /*run_warmup=*/false);
  TORCH_CHECK(status.is_good(), "plancache: FE could not load the plan: ", status.get_message());
  return graph;
}

// A configuration's executor of a plan (the one preloaded under `graph_key`, else `blob` loaded now: `loaded`),
// checked: the uids the plan binds are exactly those of the call's buffers, in whatever order.
std::shared_ptr<const Executor> load(const std::string& graph_key, const py::bytes& blob,
                                     const std::vector<int64_t>& uids, std::vector<int64_t> out_strides,
                                     bool& loaded) {
  TORCH_CHECK(!uids.empty() && uids.size() <= kMaxBuffers, "plancache: ", uids.size(), " buffers; at most ",
              kMaxBuffers);
  auto ex = std::make_shared<Executor>();
  {
    auto& st = state();
    std::shared_lock<std::shared_mutex> g(st.lock);
    auto it = st.preloaded.find(graph_key);
    if (it != st.preloaded.end()) ex->graph = it->second;
  }
  loaded = !ex->graph;
  if (loaded) ex->graph = deserialize(blob);
  std::vector<int64_t> sorted;
  {
    py::gil_scoped_release nogil;
    auto status = ex->graph->prepare_variant_pack_template();
    TORCH_CHECK(status.is_good(), "plancache: FE could not prepare the plan's variant pack: ", status.get_message());
    status = ex->graph->get_workspace_size(ex->workspace);
    TORCH_CHECK(status.is_good(), "plancache: FE could not tell the plan's workspace: ", status.get_message());
    sorted = ex->graph->get_variant_pack_uids_sorted();
  }
  TORCH_CHECK(sorted.size() == uids.size(), "plancache: the plan binds ", sorted.size(), " tensors; the call has ",
              uids.size());
  for (int64_t uid : sorted) {
    auto it = std::find(uids.begin(), uids.end(), uid);
    TORCH_CHECK(it != uids.end(), "plancache: the plan binds uid ", uid, ", which no buffer of the call has");
    ex->order.push_back(static_cast<int>(it - uids.begin()));
  }
  ex->out_strides = std::move(out_strides);
  return ex;
}

void check_installed() {
  auto& st = state();
  std::shared_lock<std::shared_mutex> g(st.lock);
  TORCH_CHECK(st.library, "plancache: the C++ attention route is not installed");
}

void add(Map& map, Key key, std::shared_ptr<const Executor> ex) {
  auto& st = state();
  std::unique_lock<std::shared_mutex> g(st.lock);
  TORCH_CHECK(st.library, "plancache: the C++ attention route is not installed");
  map[std::move(key)] = std::move(ex);
}

}  // namespace

void install(int device, py::object py_forward, py::object py_backward, bool replay) {
  auto& st = state();
  std::unique_lock<std::shared_mutex> g(st.lock);
  TORCH_CHECK(!st.library, "plancache: the C++ attention route is installed already");
  // registered in full or not at all: a library destroyed half-made unregisters what it registered
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__,
                                                  __LINE__);
  library->impl("_scaled_dot_product_cudnn_attention", TORCH_FN(forward));
  library->impl("_scaled_dot_product_cudnn_attention_backward", TORCH_FN(backward));
  st.device = device;
  st.py_forward = std::move(py_forward);
  st.py_backward = std::move(py_backward);
  st.replay = replay;
  st.served_forward = 0;
  st.served_backward = 0;
  st.replayed_forward = 0;
  st.replayed_backward = 0;
  st.captured = 0;
  st.capture_failed = 0;
  st.library = std::move(library);
}

void uninstall() {
  auto& st = state();
  std::unique_lock<std::shared_mutex> g(st.lock);
  st.library.reset();  // the kernels registered before (the Python route's) are the ops' again
  st.forward.clear();
  st.backward.clear();
  st.preloaded.clear();
  st.py_forward = py::object();
  st.py_backward = py::object();
}

void preload(const std::string& graph_key, const py::bytes& blob) {
  check_installed();
  auto graph = deserialize(blob);
  auto& st = state();
  std::unique_lock<std::shared_mutex> g(st.lock);
  TORCH_CHECK(st.library, "plancache: the C++ attention route is not installed");
  st.preloaded[graph_key] = std::move(graph);
}

// Returns whether the plan was deserialized now (not preloaded).
bool add_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& bias,
                 bool stats, double p, bool causal, std::optional<double> scale, const std::string& graph_key,
                 const py::bytes& blob, const std::vector<int64_t>& uids, std::vector<int64_t> out_strides) {
  TORCH_CHECK(out_strides.size() == 4, "plancache: the forward's output strides have ", out_strides.size(),
              " entries; expected 4");
  const size_t n = 4 + stats + bias.has_value() + 2 * (p != 0.0);
  TORCH_CHECK(uids.size() == n, "plancache: this forward binds ", n, " buffers, not ", uids.size());
  check_installed();
  bool loaded = false;
  auto ex = load(graph_key, blob, uids, std::move(out_strides), loaded);
  add(state().forward, forward_key(q, k, v, bias.value_or(at::Tensor()), stats, causal, scale, p), std::move(ex));
  return loaded;
}

// Returns whether the plan was deserialized now (not preloaded).
bool add_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  const at::Tensor& lse, const std::optional<at::Tensor>& bias, double p, bool causal,
                  std::optional<double> scale, bool deterministic, const std::string& graph_key,
                  const py::bytes& blob, const std::vector<int64_t>& uids) {
  const size_t n = 9 + bias.has_value() + 2 * (p != 0.0);
  TORCH_CHECK(uids.size() == n, "plancache: this backward binds ", n, " buffers, not ", uids.size());
  TORCH_CHECK(lse.dim() == 4, "plancache: the log-sum-exp of a backward is 4-d");
  check_installed();
  bool loaded = false;
  auto ex = load(graph_key, blob, uids, {}, loaded);
  add(state().backward,
      backward_key(q, k, v, out, lse, bias.value_or(at::Tensor()), causal, scale, p, deterministic), std::move(ex));
  return loaded;
}

// serve_forward / serve_backward for the Python route: a tuple of the kernel's outputs, or None.
py::object py_serve_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& bias, bool stats, double p, bool causal,
                            std::optional<double> scale) {
  auto served = serve_forward(q, k, v, bias.value_or(at::Tensor()), stats, causal, scale, p);
  if (!served) return py::none();
  auto& [out, lse, cum_q, cum_k, max_q, max_k, seed, offset, mask] = *served;
  return py::make_tuple(out, lse, py::none(), py::none(), max_q.guard_int(__FILE__, __LINE__),
                        max_k.guard_int(__FILE__, __LINE__), seed, offset, py::none());
}

py::object py_serve_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& seed,
                             const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias, double p,
                             bool causal, std::optional<double> scale) {
  auto served = serve_backward(dout, q, k, v, out, lse, bias.value_or(at::Tensor()), causal, scale, p,
                               seed.value_or(at::Tensor()), offset.value_or(at::Tensor()));
  if (!served) return py::none();
  auto& [dq, dk, dv] = *served;
  return py::make_tuple(dq, dk, dv);
}

py::dict counts() {
  auto& st = state();
  std::shared_lock<std::shared_mutex> g(st.lock);
  py::dict d;
  d["fwd"] = st.served_forward.load();
  d["bwd"] = st.served_backward.load();
  d["fwd_configs"] = st.forward.size();
  d["bwd_configs"] = st.backward.size();
  d["preloaded"] = st.preloaded.size();
  d["fwd_replayed"] = st.replayed_forward.load();
  d["bwd_replayed"] = st.replayed_backward.load();
  d["captured"] = st.captured.load();
  d["capture_failed"] = st.capture_failed.load();
  return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "plancache's attention route, its steady path (plancache/csrc/sdpa_route.cpp)";
  m.def("install", &install, "register the two kernels over the Python route's, calling it for what they miss; "
        "with replay, a call at an earlier call's addresses replays the launches captured there");
  m.def("uninstall", &uninstall, "unregister them and drop every plan");
  m.def("preload", &preload, "load a plan ahead, by graph key, for the configurations that will run it");
  m.def("add_forward", &add_forward, "hand over a forward configuration's plan, keyed by the call's tensors");
  m.def("add_backward", &add_backward, "hand over a backward configuration's plan, keyed by the call's tensors");
  m.def("counts", &counts, "calls served here by direction, configurations held, and replays of captured launches");
  m.def("serve_forward", &py_serve_forward, "a held forward configuration run: the kernel's outputs, or None");
  m.def("serve_backward", &py_serve_backward, "a held backward configuration run: (dq, dk, dv), or None");
}
