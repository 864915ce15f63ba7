// `F.linear(x, weight, bias)` whose weight gradient autograd never makes: backward computes the
// input's and the bias's gradients as stock autograd does, asks a Python callable for the fp32
// buffer the weight's gradient goes to (`fuse_wgrad`'s window slice, gradaccel/accumulate/slots.py,
// which keeps the window's bookkeeping) and adds dyᵀ·x onto it with the op wgrad_accumulate_
// (wgrad.cpp on CPU; the Triton kernel on CUDA). The weight gets no gradient.
//
// Why C++: this runs once per routed layer per micro-batch, and LoRA adapters route two small
// layers per adapted projection. As a Python torch.autograd.Function it cost ~115 µs a layer
// over stock F.linear on this project's CPU, more than the fold's hooks it replaces (~44 µs); as
// this, ~49 µs, the callable's Python included (bench/wgrad.py, "layer_overhead").
//
// torch::autograd::Function (the stable C++ API) rather than a hand-made Node: Node's ownership
// changed between torch releases (shared_ptr in 2.11, intrusive_ptr in 2.13); Function's API is
// the same in both.
#include <torch/extension.h>

#include <ATen/autocast_mode.h>

#include <optional>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// A Python callable kept in AutogradContext::saved_data (which holds IValues) for as long as the
// graph lives. The graph may be freed on a thread without the GIL: the destructor takes it.
struct PyCallable final : c10::ivalue::PyObjectHolder {
  explicit PyCallable(py::object obj) : obj_(std::move(obj)) {}
  ~PyCallable() override {
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  PyObject* getPyObject() override { return obj_.ptr(); }
  c10::InferredType tryToInferType() override { return c10::InferredType("a Python callable"); }
  c10::IValue toIValue(const c10::TypePtr&, std::optional<int32_t>) override {
    TORCH_CHECK(false, "gradaccel.fused_linear: the weight-gradient callable is not an IValue");
  }
  std::string toStr() override { return "<gradaccel weight-gradient callable>"; }
  std::vector<at::Tensor> extractTensors() override { return {}; }

 private:
  py::object obj_;
};

struct FusedLinear : public torch::autograd::Function<FusedLinear> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::IValue acc_of) {
    const auto dev = x.device().type();
    if (at::autocast::is_autocast_enabled(dev) && x.is_floating_point()) {
      // Save the input as autocast casts it (as stock linear saves it), not in fp32.
      x = x.to(at::autocast::get_autocast_dtype(dev));
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["acc_of"] = std::move(acc_of);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return at::linear(x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor x = saved[0], weight = saved[1];
    const at::Tensor& dy = grads[0];
    // Under autocast dy comes in the autocast dtype, as x was saved; the weight is cast as
    // forward's linear cast it.
    if (weight.scalar_type() != dy.scalar_type()) weight = weight.to(dy.scalar_type());
    if (x.scalar_type() != dy.scalar_type()) x = x.to(dy.scalar_type());
    at::Tensor dx, db;
    if (ctx->needs_input_grad(0)) dx = dy.matmul(weight);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      db = dy.reshape({-1, dy.size(-1)}).sum(0);
    }
    if (ctx->needs_input_grad(1)) {
      at::Tensor acc;
      {
        py::gil_scoped_acquire gil;  // a Python error propagates as itself
        acc = py::cast<at::Tensor>(py::handle(ctx->saved_data["acc_of"].toPyObject())());
      }
      static const auto wgrad = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("gradaccel::wgrad_accumulate_", "")
                                    .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
      wgrad.call(acc, x, dy, 1.0);
    }
    return {dx, at::Tensor(), db, at::Tensor()};
  }
};

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        py::object acc_of) {
  TORCH_CHECK_TYPE(PyCallable_Check(acc_of.ptr()), "gradaccel.fused_linear: acc_of must be callable");
  c10::intrusive_ptr<c10::ivalue::PyObjectHolder> held = c10::make_intrusive<PyCallable>(std::move(acc_of));
  return FusedLinear::apply(x, weight, bias, c10::IValue(std::move(held)));
}

}  // namespace

void init_fused_linear(py::module_& m) {
  m.def("fused_linear", &fused_linear, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("acc_of"),
        "F.linear(x, weight, bias) whose backward adds dy^T x onto acc_of() instead of making the weight's gradient.");
}
