// `F.linear(x, weight, bias)` whose weight gradient autograd never makes: backward computes the
// input's and the bias's gradients as stock autograd does, and hands (x, dy) to a Python callable
// (`fuse_wgrad`'s window sink, gradaccel/accumulate/wgrad.py), which adds dyᵀ·x into the
// weight's fp32 slice of the window. The weight gets no gradient.
//
// Why C++: this runs once per routed layer per micro-batch, and LoRA adapters route two small
// layers per adapted projection. A Python torch.autograd.Function costs about 60 µs a layer more
// than stock F.linear on this project's CPU (forward and backward in Python; bench/wgrad.py,
// "layer_overhead"); this one costs the sink's Python call and little else.
//
// torch::autograd::Function (the stable C++ API) rather than a hand-made Node: Node's ownership
// changed between torch releases (shared_ptr in 2.11, intrusive_ptr in 2.13) and this builds
// against both.
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
                            const std::optional<at::Tensor>& bias, c10::IValue add) {
    const auto dev = x.device().type();
    if (at::autocast::is_autocast_enabled(dev) && x.is_floating_point()) {
      // Save the input as autocast casts it (as stock linear saves it), not in fp32.
      x = x.to(at::autocast::get_autocast_dtype(dev));
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["add"] = std::move(add);
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
      py::gil_scoped_acquire gil;
      py::handle(ctx->saved_data["add"].toPyObject())(x, dy);  // a Python error propagates as itself
    }
    return {dx, at::Tensor(), db, at::Tensor()};
  }
};

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        py::object add) {
  TORCH_CHECK_TYPE(PyCallable_Check(add.ptr()), "gradaccel.fused_linear: add must be callable");
  c10::intrusive_ptr<c10::ivalue::PyObjectHolder> held = c10::make_intrusive<PyCallable>(std::move(add));
  return FusedLinear::apply(x, weight, bias, c10::IValue(std::move(held)));
}

}  // namespace

void init_fused_linear(py::module_& m) {
  m.def("fused_linear", &fused_linear, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("add"),
        "F.linear(x, weight, bias) whose backward calls add(x, dy) instead of making the weight's gradient.");
}
