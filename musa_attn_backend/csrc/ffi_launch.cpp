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

std::vector<at::Tensor> run(py::sequence calls, py::sequence allocs, const at::Tensor& like) {
  std::vector<at::Tensor> made;
  made.reserve(py::len(allocs));
  for (py::handle spec : allocs) {
    auto pair = spec.cast<py::tuple>();
    auto shape = pair[0].cast<std::vector<int64_t>>();
    PyObject* dtype = pair[1].ptr();
    if (!THPDtype_Check(dtype)) throw std::invalid_argument("ffi_launch: an alloc's dtype must be a torch.dtype");
    made.push_back(at::empty(shape, like.options().dtype(reinterpret_cast<THPDtype*>(dtype)->scalar_type)));
  }
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
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    if (TVMFFIFunctionCall(handle, args.data(), static_cast<int32_t>(n), &result) != 0) {
      throw std::runtime_error(take_raised());
    }
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }
  return made;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "Call compiled TVM-FFI entries with DLTensor arguments, scratch tensors made here",
        py::arg("calls"), py::arg("allocs"), py::arg("like"));
}
