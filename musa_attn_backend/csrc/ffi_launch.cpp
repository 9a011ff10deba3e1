// Compiled TileLang launches in one call from Python: the scratch tensors a call needs are made here, and each
// kernel's compiled TVM-FFI entry is called with its arguments as DLTensor pointers, on the stream torch is on.
// What this saves against calling the entries from Python: a Python torch.empty per scratch tensor, the
// conversion of every tensor argument to a TVM-FFI tensor object, and one crossing into C per launch.
//
//   run(calls, allocs, like) -> list of the allocated tensors
//     calls:  sequence of (entry handle: int, args: sequence), each arg a tensor, an int, a float, or a 1-tuple
//             (i,) standing for allocated tensor i
//     allocs: sequence of (shape: sequence of int, dtype: torch.dtype), made with like's device
//     like:   a tensor on the device the kernels run on (its current stream is set as TVM-FFI's for the calls)
//
//   Prepared(calls, allocs, slots).run(slots) -> list of the allocated tensors, or None
//     the same launches recorded once, for calls that differ only in the tensors in `slots` (a decode batch's
//     layers): an arg may also be a 2-tuple (k, view), a view of slots[k] (its dtype, shape, strides and byte
//     offset from slots[k]'s data recorded, so the view is remade over each call's slots[k] without torch).
//     run() first compares each slot with the one recorded (shape, strides, dtype, device, data pointer modulo
//     16) and returns None on any difference (the caller then takes its checked path); allocs are made with
//     slots[0]'s device. Tensors and scalars in `calls` are kept as they are.
//
// The entries check every argument themselves (dtype, shape, strides, device), as when Python calls them.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/tensor_dtypes.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

DLDataType dl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kDouble: return {kDLFloat, 64, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kShort: return {kDLInt, 16, 1};
    case at::kChar: return {kDLInt, 8, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kBool: return {kDLBool, 8, 1};
    case at::kFloat8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    default: throw std::invalid_argument(std::string("ffi_launch: no DLPack dtype for ") + c10::toString(t));
  }
}

DLDevice dl_device(const at::Device& d) {
  if (d.is_cuda()) return {kDLCUDA, static_cast<int32_t>(d.index())};
  if (d.is_cpu()) return {kDLCPU, 0};
  throw std::invalid_argument("ffi_launch: tensors on " + d.str() + " are not supported (CUDA and CPU only)");
}

void to_dl(const at::Tensor& t, DLTensor* out) {
  out->data = t.data_ptr();  // the storage offset applied here: the entries require byte_offset 0
  out->device = dl_device(t.device());
  out->ndim = static_cast<int32_t>(t.dim());
  out->dtype = dl_dtype(t.scalar_type());
  out->shape = const_cast<int64_t*>(t.sizes().data());
  out->strides = const_cast<int64_t*>(t.strides().data());
  out->byte_offset = 0;
}

std::string take_raised() {
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) return "unknown error";
  TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  std::string text = std::string(cell->kind.data, cell->kind.size) + ": " +
                     std::string(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return text;
}

// The stream torch is on for `device` as TVM-FFI's environment stream while alive (CUDA only).
struct EnvStream {
  int32_t type = 0, id = 0;
  TVMFFIStreamHandle previous = nullptr;
  bool set = false;
  explicit EnvStream(const at::Device& device) {
    if (!device.is_cuda()) return;
    c10::impl::VirtualGuardImpl impl(device.type());
    void* stream = impl.getStream(device).native_handle();
    type = kDLCUDA;
    id = static_cast<int32_t>(device.index());
    if (TVMFFIEnvSetStream(type, id, stream, &previous) != 0) throw std::runtime_error(take_raised());
    set = true;
  }
  ~EnvStream() {
    if (set) TVMFFIEnvSetStream(type, id, previous, nullptr);
  }
};

void call_entry(TVMFFIObjectHandle handle, std::vector<TVMFFIAny>& args) {
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  if (TVMFFIFunctionCall(handle, args.data(), static_cast<int32_t>(args.size()), &result) != 0) {
    throw std::runtime_error(take_raised());
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
}

using AllocSpecs = std::vector<std::pair<std::vector<int64_t>, at::ScalarType>>;

// allocs: sequence of (shape, torch.dtype)
AllocSpecs parse_allocs(py::sequence allocs) {
  AllocSpecs specs;
  for (py::handle spec : allocs) {
    auto pair = spec.cast<py::tuple>();
    PyObject* dtype = pair[1].ptr();
    if (!THPDtype_Check(dtype)) throw std::invalid_argument("ffi_launch: an alloc's dtype must be a torch.dtype");
    specs.emplace_back(pair[0].cast<std::vector<int64_t>>(), reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  }
  return specs;
}

std::vector<at::Tensor> make_allocs(const AllocSpecs& specs, const at::Tensor& like) {
  std::vector<at::Tensor> made;
  made.reserve(specs.size());
  for (const auto& spec : specs) made.push_back(at::empty(spec.first, like.options().dtype(spec.second)));
  return made;
}

std::vector<at::Tensor> run(py::sequence calls, py::sequence allocs, const at::Tensor& like) {
  std::vector<at::Tensor> made = make_allocs(parse_allocs(allocs), like);
  EnvStream env(like.device());
  std::vector<at::Tensor> held;  // tensors whose shape and stride arrays the DLTensors point into
  std::vector<DLTensor> tensors;
  std::vector<TVMFFIAny> args;
  for (py::handle call : calls) {
    auto pair = call.cast<py::tuple>();
    auto handle = reinterpret_cast<TVMFFIObjectHandle>(pair[0].cast<intptr_t>());
    py::sequence items = pair[1].cast<py::sequence>();
    size_t n = py::len(items);
    held.clear();
    held.reserve(n);
    tensors.assign(n, DLTensor{});
    args.assign(n, TVMFFIAny{});
    size_t i = 0;
    for (py::handle item : items) {
      PyObject* o = item.ptr();
      TVMFFIAny& a = args[i];
      a.zero_padding = 0;
      if (THPVariable_Check(o)) {
        held.push_back(THPVariable_Unpack(o));
      } else if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 1) {
        held.push_back(made.at(PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 0))));
      } else if (PyFloat_Check(o)) {
        a.type_index = kTVMFFIFloat;
        a.v_float64 = PyFloat_AS_DOUBLE(o);
        ++i;
        continue;
      } else if (PyLong_Check(o)) {
        a.type_index = kTVMFFIInt;
        a.v_int64 = PyLong_AsLongLong(o);
        ++i;
        continue;
      } else {
        throw std::invalid_argument("ffi_launch: argument " + std::to_string(i) + " is " +
                                    std::string(Py_TYPE(o)->tp_name) + "; tensors, ints, floats or (i,) only");
      }
      to_dl(held.back(), &tensors[i]);
      a.type_index = kTVMFFIDLTensorPtr;
      a.v_ptr = &tensors[i];
      ++i;
    }
    call_entry(handle, args);
  }
  return made;
}

class Prepared {
 public:
  Prepared(py::sequence calls, py::sequence allocs, py::sequence slots) : allocs_(parse_allocs(allocs)) {
    for (py::handle h : slots) {
      if (!THPVariable_Check(h.ptr())) throw std::invalid_argument("ffi_launch: Prepared's slots must be tensors");
      const at::Tensor& t = THPVariable_Unpack(h.ptr());
      expect_.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device(),
                         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16, reinterpret_cast<uintptr_t>(t.data_ptr())});
    }
    if (expect_.empty()) throw std::invalid_argument("ffi_launch: Prepared needs at least one slot");
    for (py::handle call : calls) {
      auto pair = call.cast<py::tuple>();
      Call c;
      c.handle = reinterpret_cast<TVMFFIObjectHandle>(pair[0].cast<intptr_t>());
      size_t i = 0;
      for (py::handle item : pair[1].cast<py::sequence>()) {
        PyObject* o = item.ptr();
        Arg a;
        if (THPVariable_Check(o)) {
          a.kind = Arg::kFixed;
          a.fixed = THPVariable_Unpack(o);
        } else if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 1) {
          a.kind = Arg::kAlloc;
          a.index = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 0));
          if (a.index < 0 || a.index >= static_cast<int64_t>(allocs_.size())) {
            throw std::out_of_range("ffi_launch: argument " + std::to_string(i) + " names a missing alloc");
          }
        } else if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2) {
          a.kind = Arg::kSlot;
          a.index = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 0));
          if (a.index < 0 || a.index >= static_cast<int64_t>(expect_.size()) ||
              !THPVariable_Check(PyTuple_GET_ITEM(o, 1))) {
            throw std::invalid_argument("ffi_launch: argument " + std::to_string(i) +
                                        " must be (slot index, view of that slot)");
          }
          const at::Tensor& view = THPVariable_Unpack(PyTuple_GET_ITEM(o, 1));
          a.offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(view.data_ptr()) - expect_[a.index].ptr);
          a.shape = view.sizes().vec();
          a.strides = view.strides().vec();
          a.dtype = dl_dtype(view.scalar_type());
        } else if (PyFloat_Check(o)) {
          a.kind = Arg::kScalar;
          a.scalar.type_index = kTVMFFIFloat;
          a.scalar.zero_padding = 0;
          a.scalar.v_float64 = PyFloat_AS_DOUBLE(o);
        } else if (PyLong_Check(o)) {
          a.kind = Arg::kScalar;
          a.scalar.type_index = kTVMFFIInt;
          a.scalar.zero_padding = 0;
          a.scalar.v_int64 = PyLong_AsLongLong(o);
        } else {
          throw std::invalid_argument("ffi_launch: argument " + std::to_string(i) + " is " +
                                      std::string(Py_TYPE(o)->tp_name) +
                                      "; tensors, ints, floats, (i,) or (slot, view) only");
        }
        c.args.push_back(std::move(a));
        ++i;
      }
      calls_.push_back(std::move(c));
    }
  }

  py::object run(py::list slots) {
    size_t n = py::len(slots);
    if (n != expect_.size()) return py::none();
    std::vector<at::Tensor> given;
    given.reserve(n);
    for (size_t k = 0; k < n; ++k) {
      PyObject* o = PyList_GET_ITEM(slots.ptr(), k);
      if (!THPVariable_Check(o)) return py::none();
      const at::Tensor& t = THPVariable_Unpack(o);
      const Expect& e = expect_[k];
      if (t.scalar_type() != e.dtype || t.device() != e.device || t.sizes() != at::IntArrayRef(e.sizes) ||
          t.strides() != at::IntArrayRef(e.strides) ||
          reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != e.align) {
        return py::none();
      }
      given.push_back(t);
    }
    std::vector<at::Tensor> made = make_allocs(allocs_, given[0]);
    EnvStream env(given[0].device());
    std::vector<DLTensor> tensors;
    std::vector<TVMFFIAny> args;
    for (const Call& c : calls_) {
      size_t m = c.args.size();
      tensors.assign(m, DLTensor{});
      args.assign(m, TVMFFIAny{});
      for (size_t i = 0; i < m; ++i) {
        const Arg& a = c.args[i];
        if (a.kind == Arg::kScalar) {
          args[i] = a.scalar;
          continue;
        }
        DLTensor& d = tensors[i];
        if (a.kind == Arg::kFixed) {
          to_dl(a.fixed, &d);
        } else if (a.kind == Arg::kAlloc) {
          to_dl(made[a.index], &d);
        } else {
          const at::Tensor& base = given[a.index];
          d.data = static_cast<char*>(base.data_ptr()) + a.offset;
          d.device = dl_device(base.device());
          d.ndim = static_cast<int32_t>(a.shape.size());
          d.dtype = a.dtype;
          d.shape = const_cast<int64_t*>(a.shape.data());
          d.strides = const_cast<int64_t*>(a.strides.data());
          d.byte_offset = 0;
        }
        args[i].type_index = kTVMFFIDLTensorPtr;
        args[i].zero_padding = 0;
        args[i].v_ptr = &d;
      }
      call_entry(c.handle, args);
    }
    return py::cast(made);
  }

 private:
  struct Expect {
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype;
    at::Device device;
    uintptr_t align, ptr;
  };
  struct Arg {
    enum Kind { kFixed, kAlloc, kSlot, kScalar } kind = kScalar;
    at::Tensor fixed;
    int64_t index = 0, offset = 0;
    std::vector<int64_t> shape, strides;
    DLDataType dtype{};
    TVMFFIAny scalar{};
  };
  struct Call {
    TVMFFIObjectHandle handle = nullptr;
    std::vector<Arg> args;
  };
  AllocSpecs allocs_;
  std::vector<Expect> expect_;
  std::vector<Call> calls_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Prepared>(m, "Prepared")
      .def(py::init<py::sequence, py::sequence, py::sequence>(), py::arg("calls"), py::arg("allocs"),
           py::arg("slots"))
      .def("run", &Prepared::run, py::arg("slots"));
  m.def("run", &run, "Call compiled TVM-FFI entries with DLTensor arguments, scratch tensors made here",
        py::arg("calls"), py::arg("allocs"), py::arg("like"));
}
