// hps._core: converts numpy arrays and Python values to the native API and
// back, releasing the GIL around every bulk call. No logic lives here beyond
// checking that an argument has the type, shape and layout the call needs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "hps/admission.h"
#include "hps/backing_store.h"
#include "hps/config.h"
#include "hps/device_tier.h"
#include "hps/hash_table.h"
#include "hps/herald.h"
#include "hps/mem_cache.h"
#include "hps/narrow_linear.h"
#include "hps/optimizer.h"
#include "hps/ssd_store.h"
#include "hps/topology.h"
#include "hps/working_set.h"

namespace py = pybind11;

namespace {

std::string DtypeName(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

void RequireContiguous(const py::array& a, const char* name) {
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) +
                          " must be C-contiguous; pass numpy.ascontiguousarray(" + name + ")");
  }
}

// Whether `a` holds T. By equivalence, not identity: an array that went through
// pickle (multiprocessing, a DataLoader worker) carries an equal dtype object
// that is not numpy's own, and was refused as "uint64, got uint64".
template <typename T>
bool HasDtype(const py::array& a) {
  return py::array_t<T>::check_(a);
}

// A checked key array: 1-D uint64 (or int64, reinterpreted bit for bit).
struct Keys {
  const uint64_t* data;
  uint64_t n;
};

Keys KeysArg(const py::array& a, const char* name) {
  if (!HasDtype<uint64_t>(a) && !HasDtype<int64_t>(a)) {
    throw py::type_error(std::string(name) + " must be an array of uint64 or int64, got " +
                         DtypeName(a));
  }
  if (a.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) +
                          " dimensions");
  }
  RequireContiguous(a, name);
  return {static_cast<const uint64_t*>(a.data()), static_cast<uint64_t>(a.shape(0))};
}

// An array's shape as numpy prints it: (3,), (2, 5).
std::string ShapeOf(const py::array& a) {
  std::string shape = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (d > 0) shape.append(", ");
    shape.append(std::to_string(a.shape(d)));
  }
  return shape + (a.ndim() == 1 ? ",)" : ")");
}

// A float32 (n, columns) array.
hps::WorkingSet::Memory MemoryArg(bool on_gpu) {
  return on_gpu ? hps::WorkingSet::Memory::kWorkerGpu : hps::WorkingSet::Memory::kHost;
}

const float* RowsArg(const py::array& a, const char* name, uint64_t n, int64_t columns) {
  if (!HasDtype<float>(a)) {
    throw py::type_error(std::string(name) + " must be an array of float32, got " + DtypeName(a));
  }
  if (a.ndim() != 2 || static_cast<uint64_t>(a.shape(0)) != n || a.shape(1) != columns) {
    throw py::value_error(std::string(name) + " must have shape (" + std::to_string(n) + ", " +
                          std::to_string(columns) + "), got " + ShapeOf(a));
  }
  RequireContiguous(a, name);
  return static_cast<const float*>(a.data());
}

// An optional float32 vector of n, contiguous (None: null): a bias or its
// gradient. The pointer is into the caller's array, which outlives the call.
float* OptionalVectorArg(const py::object& v, const char* name, int64_t n, bool write) {
  if (v.is_none()) return nullptr;
  py::array a = v.cast<py::array>();
  if (!HasDtype<float>(a)) {
    throw py::type_error(std::string(name) + " must be an array of float32, got " + DtypeName(a));
  }
  if (a.ndim() != 1 || a.shape(0) != n) {
    throw py::value_error(std::string(name) + " must have shape (" + std::to_string(n) + ",), got " + ShapeOf(a));
  }
  RequireContiguous(a, name);
  if (write && !a.writeable()) throw py::value_error(std::string(name) + " is read-only");
  return static_cast<float*>(const_cast<void*>(a.data()));
}

// A 2-D float32 array whose rows are runs of floats (a column range of a wider
// matrix too): its data and row stride in floats.
struct FloatRows {
  float* data;
  int64_t rows, columns, stride;
};

FloatRows FloatRowsArg(const py::array& a, const char* name) {
  if (!HasDtype<float>(a)) {
    throw py::type_error(std::string(name) + " must be an array of float32, got " + DtypeName(a));
  }
  if (a.ndim() != 2) throw py::value_error(std::string(name) + " must be 2-D, got shape " + ShapeOf(a));
  const auto unit = static_cast<py::ssize_t>(sizeof(float));
  // An empty array's strides say nothing (numpy makes them 0).
  if (a.size() > 0 && ((a.shape(1) > 1 && a.strides(1) != unit) || a.strides(0) % unit != 0 || a.strides(0) < 0)) {
    throw py::value_error(std::string(name) + " must have rows of consecutive float32 (a row-major array or a "
                          "column range of one)");
  }
  const int64_t stride = a.shape(0) > 1 ? a.strides(0) / unit : a.shape(1);
  return {static_cast<float*>(const_cast<void*>(a.data())), a.shape(0), a.shape(1), stride};
}


// n rows of dim float32 in a 2-D array: a C-contiguous (n, dim) one, or a
// column range (B, k * dim) of a wider matrix with B * k = n, whose row
// stride HostBatch's RowLayout then follows.
struct LaidOutRows {
  float* data;
  hps::RowLayout layout;
};

LaidOutRows LaidOutRowsArg(const py::array& a, const char* name, uint64_t n, int32_t dim, bool write) {
  if (!HasDtype<float>(a)) {
    throw py::type_error(std::string(name) + " must be an array of float32, got " + DtypeName(a));
  }
  // An empty array's strides say nothing (numpy makes them 0): its shape alone must fit.
  const bool fits = a.ndim() == 2 && a.shape(1) > 0 && a.shape(1) % dim == 0 &&
                    (a.shape(0) == 0 ||
                     (a.strides(1) == sizeof(float) && a.strides(0) % static_cast<py::ssize_t>(sizeof(float)) == 0 &&
                      (a.shape(0) <= 1 || a.strides(0) >= a.shape(1) * static_cast<py::ssize_t>(sizeof(float))))) &&
                    static_cast<uint64_t>(a.shape(0)) * static_cast<uint64_t>(a.shape(1) / dim) == n;
  if (!fits) {
    throw py::value_error(std::string(name) + " must hold " + std::to_string(n) + " rows of " +
                          std::to_string(dim) + " float32: shape (" + std::to_string(n) + ", " +
                          std::to_string(dim) + "), or (B, k * " + std::to_string(dim) +
                          ") with B * k = " + std::to_string(n) + " and adjacent columns; got shape " + ShapeOf(a));
  }
  if (write && !a.writeable()) throw py::value_error(std::string(name) + " must be writeable");
  const uint64_t group = static_cast<uint64_t>(a.shape(1) / dim);
  const uint64_t stride = a.shape(0) <= 1 ? group * static_cast<uint64_t>(dim)
                                          : static_cast<uint64_t>(a.strides(0)) / sizeof(float);
  return {static_cast<float*>(const_cast<void*>(a.data())), {group, stride}};
}

// A C-contiguous (n, k) array of any dtype whose rows are row_bytes long.
const uint8_t* ByteRowsArg(const py::array& a, const char* name, uint64_t n, uint32_t row_bytes) {
  if (a.ndim() != 2 || static_cast<uint64_t>(a.shape(0)) != n ||
      static_cast<uint64_t>(a.shape(1) * a.itemsize()) != row_bytes) {
    throw py::value_error(std::string(name) + " must be a 2-D array of " + std::to_string(n) +
                          " rows of " + std::to_string(row_bytes) + " bytes each");
  }
  RequireContiguous(a, name);
  return static_cast<const uint8_t*>(a.data());
}

py::array_t<float> NewRows(uint64_t n, int64_t columns) {
  return py::array_t<float>({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(columns)});
}

// A fresh (n, columns) float32 array, filled by fill(data) without the GIL.
template <class Fill>
py::array_t<float> FilledRows(uint64_t n, int64_t columns, const Fill& fill) {
  py::array_t<float> out = NewRows(n, columns);
  float* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    fill(o);
  }
  return out;
}

uint8_t* Bytes(py::array_t<bool>& a) { return reinterpret_cast<uint8_t*>(a.mutable_data()); }

// Runs lookup(rows_out, found_out) without the GIL over fresh arrays of n rows
// and returns (rows, found).
template <class T, class Lookup>
py::tuple RowsAndFound(uint64_t n, uint64_t columns, const Lookup& lookup) {
  py::array_t<T> rows({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(columns)});
  py::array_t<bool> found(static_cast<py::ssize_t>(n));
  T* out = rows.mutable_data();
  uint8_t* flags = Bytes(found);
  {
    py::gil_scoped_release release;
    lookup(out, flags);
  }
  return py::make_tuple(rows, found);
}

// A 1-D C-contiguous int64 array (positions, inverse indices).
struct Positions {
  const int64_t* data;
  uint64_t n;
};

Positions PositionsArg(const py::array& a, const char* name) {
  if (!HasDtype<int64_t>(a) || a.ndim() != 1) {
    throw py::type_error(std::string(name) + " must be a 1-D array of int64, got " + DtypeName(a) + " with " +
                         std::to_string(a.ndim()) + " dimensions");
  }
  RequireContiguous(a, name);
  return {static_cast<const int64_t*>(a.data()), static_cast<uint64_t>(a.shape(0))};
}

// get_at and accumulate_at of a batch's rows bound by position (a working set,
// a device tier): embeddings into a new (n, dim) array or into `out`, and
// gradients read, laid out as LaidOutRowsArg takes them.
template <typename Bound>
py::object GetAtArg(Bound& bound, int32_t worker, const py::array& positions, const py::object& out) {
  const auto [p, n] = PositionsArg(positions, "positions");
  if (out.is_none()) {
    return FilledRows(n, bound.dim(), [&, p = p, n = n](float* e) { bound.GetAt(worker, p, n, e, hps::RowLayout{}); });
  }
  const LaidOutRows rows = LaidOutRowsArg(out.cast<py::array>(), "out", n, bound.dim(), true);
  {
    py::gil_scoped_release release;
    bound.GetAt(worker, p, n, rows.data, rows.layout);
  }
  return out;
}

template <typename Bound>
void AccumulateAtArg(Bound& bound, int32_t worker, const py::array& positions, const py::array& grads) {
  const auto [p, n] = PositionsArg(positions, "positions");
  const LaidOutRows rows = LaidOutRowsArg(grads, "grads", n, bound.dim(), false);
  py::gil_scoped_release release;
  bound.AccumulateAt(worker, p, n, rows.data, rows.layout);
}

constexpr const char* kGetAtOut =
    "out: (n, dim), or (B, k * dim) with B * k = n, possibly a wider matrix's first columns (reads_in_place)";

// Where MemCache::Pin left a batch's rows, for the HostBatch of those keys;
// holds the cache so that the addresses cannot outlive it.
struct RowAddresses {
  py::object cache;
  std::vector<uint8_t*> rows;
};

// A run's device-tier routes (hps::PlanTierRoutes), read-only, shared by the
// tiers made with them.
struct TierRoutesHandle {
  std::shared_ptr<const hps::TierRoutes> routes;
};

// The caster of every class bound here: refuses an instance whose constructor did
// not finish. A Python subclass's __init__ that raised (hps.MemCache refusing a
// policy, hps.SsdStore a row size) leaves self alive in the traceback's frame, where
// pytest's and debuggers' reprs call its methods; X.__new__(X) makes one too.
// pybind11 hands such an instance's methods fresh uninitialized memory of the
// class's size (its lazy allocation for placement-new constructors, which no class
// here has), and the first virtual call or field read crashed the process.
template <typename T>
class ConstructedCaster : public py::detail::type_caster_base<T> {
 public:
  bool load(py::handle src, bool convert) {
    const py::detail::type_info* info = this->typeinfo;
    if (info != nullptr && src && PyObject_TypeCheck(src.ptr(), info->type) &&
        reinterpret_cast<py::detail::instance*>(src.ptr())->get_value_and_holder(info).value_ptr() == nullptr) {
      const py::handle type = py::type::handle_of(src);
      throw py::value_error(py::str("this {}.{} was never built (its constructor raised, or only __new__ made it): "
                                    "make a new one")
                                .format(type.attr("__module__"), type.attr("__qualname__")));
    }
    return py::detail::type_caster_base<T>::load(src, convert);
  }
};

}  // namespace

// Declared before any cast of these types instantiates pybind11's own caster.
#define HPS_CONSTRUCTED_CASTER(T) \
  template <>                     \
  class pybind11::detail::type_caster<T> : public ConstructedCaster<T> {}
HPS_CONSTRUCTED_CASTER(hps::SparseOptimizer);
HPS_CONSTRUCTED_CASTER(hps::HashTable);
HPS_CONSTRUCTED_CASTER(hps::SsdStore);
HPS_CONSTRUCTED_CASTER(hps::BackingStore);
HPS_CONSTRUCTED_CASTER(hps::MemCache);
HPS_CONSTRUCTED_CASTER(hps::DeviceTier);
HPS_CONSTRUCTED_CASTER(RowAddresses);
HPS_CONSTRUCTED_CASTER(hps::HostBatch);
HPS_CONSTRUCTED_CASTER(hps::WorkingSet);
HPS_CONSTRUCTED_CASTER(hps::Herald);
HPS_CONSTRUCTED_CASTER(hps::AdmissionSketch);
HPS_CONSTRUCTED_CASTER(TierRoutesHandle);
#undef HPS_CONSTRUCTED_CASTER

namespace {

// A Python loader, called from native code without the GIL: takes a uint64
// array, returns (rows of row_bytes each, dirty bool array).
hps::RowLoader PythonLoader(py::object loader, uint32_t row_bytes) {
  if (loader.is_none()) return {};
  auto held = std::make_shared<py::object>(std::move(loader));
  return [held, row_bytes](const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty) {
    py::gil_scoped_acquire acquire;
    py::array_t<uint64_t> k(static_cast<py::ssize_t>(n));
    std::memcpy(k.mutable_data(), keys, n * sizeof(uint64_t));
    const py::tuple result = (*held)(k);
    if (result.size() != 2) throw py::value_error("MEM-PS loader must return (rows, dirty)");
    const py::array r = py::array::ensure(result[0]);
    std::memcpy(rows, ByteRowsArg(r, "loader rows", n, row_bytes), n * row_bytes);
    const py::array_t<bool, py::array::c_style | py::array::forcecast> d(result[1]);
    if (static_cast<uint64_t>(d.size()) != n) throw py::value_error("MEM-PS loader: dirty must have one flag a key");
    std::memcpy(dirty, d.data(), n);
  };
}

// A Python sink, called from native code without the GIL with (keys, rows as
// an (n, row_bytes) uint8 array); both arrays are copies it may keep.
hps::RowSink PythonSink(py::object sink, uint32_t row_bytes) {
  if (sink.is_none()) return {};
  auto held = std::make_shared<py::object>(std::move(sink));
  return [held, row_bytes](const uint64_t* keys, uint64_t n, const uint8_t* rows) {
    py::gil_scoped_acquire acquire;
    py::array_t<uint64_t> k(static_cast<py::ssize_t>(n));
    std::memcpy(k.mutable_data(), keys, n * sizeof(uint64_t));
    py::array_t<uint8_t> r({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(row_bytes)});
    std::memcpy(r.mutable_data(), rows, n * row_bytes);
    (*held)(k, r);
  };
}

// MEM-PS's loader and sink: a BackingStore's (native: no GIL taken on a
// miss), or Python callables'.
hps::BackingStore* BackingArg(const py::object& backing, const char* name, uint32_t row_bytes) {
  auto* b = backing.cast<hps::BackingStore*>();
  if (b->row_bytes() != row_bytes) {
    throw py::value_error(std::string(name) + ": a BackingStore of " + std::to_string(b->row_bytes()) +
                          "-byte rows for a cache of " + std::to_string(row_bytes) + "-byte rows");
  }
  return b;
}

hps::RowLoader LoaderArg(py::object loader, uint32_t row_bytes) {
  if (py::isinstance<hps::BackingStore>(loader)) return BackingArg(loader, "loader", row_bytes)->loader();
  return PythonLoader(std::move(loader), row_bytes);
}

hps::RowSink SinkArg(py::object sink, uint32_t row_bytes) {
  if (py::isinstance<hps::BackingStore>(sink)) return BackingArg(sink, "sink", row_bytes)->sink();
  return PythonSink(std::move(sink), row_bytes);
}

// Optional device ids, one int32 per key.
const int32_t* OwnersArg(const py::object& owners, uint64_t n) {
  if (owners.is_none()) return nullptr;
  const py::array a = py::array::ensure(owners);
  if (!a || !HasDtype<int32_t>(a) || a.ndim() != 1 || static_cast<uint64_t>(a.shape(0)) != n) {
    throw py::type_error("owners must be None or a 1-D int32 array with one device id a key (" +
                         std::to_string(n) + ")");
  }
  RequireContiguous(a, "owners");
  return static_cast<const int32_t*>(a.data());
}

hps::OptimizerKind ParseOptimizer(const std::string& name) {
  if (name == "sgd") return hps::OptimizerKind::kSgd;
  if (name == "adagrad") return hps::OptimizerKind::kAdaGrad;
  if (name == "rowwise_adagrad") return hps::OptimizerKind::kRowWiseAdaGrad;
  if (name == "adam") return hps::OptimizerKind::kAdam;
  throw py::value_error("optimizer kind must be one of sgd, adagrad, rowwise_adagrad, adam; got '" +
                        name + "'");
}

hps::InitKind ParseInit(const std::string& name) {
  if (name == "zeros") return hps::InitKind::kZeros;
  if (name == "uniform") return hps::InitKind::kUniform;
  if (name == "normal") return hps::InitKind::kNormal;
  throw py::value_error("initializer must be one of zeros, uniform, normal; got '" + name + "'");
}

std::string InitName(hps::InitKind kind) {
  switch (kind) {
    case hps::InitKind::kZeros:
      return "zeros";
    case hps::InitKind::kUniform:
      return "uniform";
    case hps::InitKind::kNormal:
      return "normal";
  }
  return "unknown";
}

using Table = hps::HashTable;

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "hps native core (hash table, sparse optimizers)";
  m.attr("__version__") = HPS_VERSION;
  m.attr("EMPTY_KEY") = py::int_(hps::kEmptyKey);
  // The root of hps's own errors; bad arguments stay ValueError / TypeError.
  py::object hps_error = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("hps._core.HpsError", "Base class of errors raised by hps.",
                                PyExc_Exception, nullptr));
  m.attr("HpsError") = hps_error;
  py::register_exception<hps::TableFullError>(m, "TableFullError", hps_error.ptr());
  py::register_exception<hps::CorruptionError>(m, "CorruptionError", hps_error.ptr());
  py::register_exception<hps::IoError>(m, "IoError", hps_error.ptr());
  // DivergedError is Python's (hps.errors, where its docstring says every case:
  // a loss that is not a number is found in Python), raised from here too.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hps::DivergedError& e) {
      PyErr_SetString(py::module_::import("hps.errors").attr("DivergedError").ptr(), e.what());
    }
  });

  m.def("cuda_compiled", &hps::CudaCompiled, "Whether this build has the CUDA launchers.");
  m.def("liburing_compiled", [] { return bool{HPS_HAVE_LIBURING}; },
        "Whether this build has io_uring (liburing); without it SSD-PS moves rows with pread/pwrite.");
  m.def("cuda_device_count", &hps::CudaDeviceCount,
        "Usable CUDA devices; 0 without a GPU or a recent enough driver.");

  py::class_<hps::SparseOptimizer>(m, "SparseOptimizer")
      .def(py::init([](int32_t dim, const std::string& kind, float lr, float beta1, float beta2,
                       float eps, float initial_accumulator, const std::string& init,
                       float init_scale, uint64_t seed) {
             hps::SparseOptimizer o;
             o.dim = dim;
             o.opt = {ParseOptimizer(kind), lr, beta1, beta2, eps, initial_accumulator};
             o.init = {ParseInit(init), init_scale, seed};
             o.validate();
             return o;
           }),
           py::arg("dim"), py::arg("kind"), py::arg("lr"), py::arg("beta1") = 0.9f,
           py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f, py::arg("initial_accumulator") = 0.0f,
           py::arg("init") = "uniform", py::arg("init_scale") = 0.01f, py::arg("seed") = 0)
      .def_property_readonly("dim", [](const hps::SparseOptimizer& o) { return o.dim; })
      .def_property_readonly("kind", [](const hps::SparseOptimizer& o) { return hps::ToString(o.opt.kind); })
      .def_property_readonly("lr", [](const hps::SparseOptimizer& o) { return o.opt.lr; })
      .def_property_readonly("beta1", [](const hps::SparseOptimizer& o) { return o.opt.beta1; })
      .def_property_readonly("beta2", [](const hps::SparseOptimizer& o) { return o.opt.beta2; })
      .def_property_readonly("eps", [](const hps::SparseOptimizer& o) { return o.opt.eps; })
      .def_property_readonly("initial_accumulator",
                             [](const hps::SparseOptimizer& o) { return o.opt.initial_accumulator; })
      .def_property_readonly("init", [](const hps::SparseOptimizer& o) { return InitName(o.init.kind); })
      .def_property_readonly("init_scale", [](const hps::SparseOptimizer& o) { return o.init.scale; })
      .def_property_readonly("seed", [](const hps::SparseOptimizer& o) { return o.init.seed; })
      .def_property_readonly("row_floats", &hps::SparseOptimizer::row_floats)
      .def("initial_rows", [](const hps::SparseOptimizer& o, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        hps::CheckKeys(k, n);
        auto out = NewRows(n, o.row_floats());
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release release;
          o.initial_rows(k, n, dst);
        }
        return out;
      }, py::arg("keys"), "Initial rows (n, row_floats) of keys: embedding then optimizer state.")
      .def("initial_embeddings", [](const hps::SparseOptimizer& o, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        hps::CheckKeys(k, n);
        auto out = NewRows(n, o.dim);
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release release;
          o.initial_embeddings(k, n, dst);
        }
        return out;
      }, py::arg("keys"), "The embeddings (n, dim) of keys' initial rows: initial_rows' first dim floats.");

  py::class_<Table>(m, "HashTable")
      .def(py::init([](uint64_t capacity, int32_t row_floats, int32_t threads, int32_t cuda_device) {
             return hps::NewHashTable({capacity, row_floats, threads, cuda_device});
           }),
           py::arg("capacity"), py::arg("row_floats"), py::arg("threads") = 0,
           py::arg("cuda_device") = -1)
      .def_property_readonly("capacity", &Table::capacity)
      .def_property_readonly("row_floats", &Table::row_floats)
      .def_property_readonly("device", &Table::device)
      .def("__len__", &Table::size)
      .def_property_readonly("size", &Table::size)
      .def("insert", [](Table& t, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        const float* r = RowsArg(rows, "rows", n, t.row_floats());
        py::array_t<bool> inserted(static_cast<py::ssize_t>(n));
        uint8_t* flags = Bytes(inserted);
        {
          py::gil_scoped_release release;
          t.insert(k, n, r, flags);
        }
        return inserted;
      }, py::arg("keys"), py::arg("rows"))
      .def("find", [](const Table& t, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        return RowsAndFound<float>(n, static_cast<uint64_t>(t.row_floats()),
                                   [&, k = k, n = n](float* out, uint8_t* flags) { t.find(k, n, out, flags); });
      }, py::arg("keys"))
      .def("accumulate", [](Table& t, const py::array& keys, const py::array& deltas) {
        const auto [k, n] = KeysArg(keys, "keys");
        const float* d = RowsArg(deltas, "deltas", n, t.row_floats());
        py::gil_scoped_release release;
        t.accumulate(k, n, d);
      }, py::arg("keys"), py::arg("deltas"))
      .def("assign", [](Table& t, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        const float* r = RowsArg(rows, "rows", n, t.row_floats());
        py::array_t<bool> found(static_cast<py::ssize_t>(n));
        uint8_t* flags = Bytes(found);
        {
          py::gil_scoped_release release;
          t.assign(k, n, r, flags);
        }
        return found;
      }, py::arg("keys"), py::arg("rows"))
      .def("lookup_or_init", [](Table& t, const py::array& keys, const hps::SparseOptimizer& opt) {
        const auto [k, n] = KeysArg(keys, "keys");
        auto out = NewRows(n, opt.dim);
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release release;
          t.lookup_or_init(k, n, opt, dst);
        }
        return out;
      }, py::arg("keys"), py::arg("optimizer"))
      .def("apply_gradients",
           [](Table& t, const py::array& keys, const py::array& grads, const hps::SparseOptimizer& opt) {
             const auto [k, n] = KeysArg(keys, "keys");
             const float* g = RowsArg(grads, "grads", n, opt.dim);
             py::gil_scoped_release release;
             t.apply_gradients(k, n, g, opt);
           },
           py::arg("keys"), py::arg("grads"), py::arg("optimizer"))
      .def("export", [](const Table& t) {
        const uint64_t n = t.size();
        py::array_t<uint64_t> keys(static_cast<py::ssize_t>(n));
        auto rows = NewRows(n, t.row_floats());
        uint64_t* k = keys.mutable_data();
        float* r = rows.mutable_data();
        uint64_t written = 0;
        {
          py::gil_scoped_release release;
          written = t.export_rows(k, r, n);
        }
        if (written != n) {  // only when another thread inserted mid-export
          keys.resize({static_cast<py::ssize_t>(written)});
          rows.resize({static_cast<py::ssize_t>(written), static_cast<py::ssize_t>(t.row_floats())});
        }
        return py::make_tuple(keys, rows);
      })
      .def("clear", [](Table& t) {
        py::gil_scoped_release release;
        t.clear();
      });

  py::class_<hps::SsdStore>(m, "SsdStore")
      .def(py::init([](const std::string& path, uint32_t row_bytes, uint64_t file_records,
                       bool verify_rows_on_open, double compaction_trigger, bool use_io_uring,
                       bool direct_io, bool background_compaction, bool require_direct_io) {
             return hps::SsdStore::Open({path, row_bytes, file_records, verify_rows_on_open,
                                         compaction_trigger, use_io_uring, direct_io,
                                         background_compaction, require_direct_io});
           }),
           py::arg("path"), py::arg("row_bytes"), py::arg("file_records") = uint64_t{1} << 16,
           py::arg("verify_rows_on_open") = false, py::arg("compaction_trigger") = 1.5,
           py::arg("use_io_uring") = true, py::arg("direct_io") = true,
           py::arg("background_compaction") = true, py::arg("require_direct_io") = false)
      .def_property_readonly("row_bytes", &hps::SsdStore::row_bytes)
      .def_property_readonly("io_fallback", &hps::SsdStore::io_fallback)
      .def("__len__", &hps::SsdStore::size)
      .def("put", [](hps::SsdStore& s, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        const uint8_t* r = ByteRowsArg(rows, "rows", n, s.row_bytes());
        py::gil_scoped_release release;
        s.Put(k, n, r);
      }, py::arg("keys"), py::arg("rows"))
      .def("get", [](hps::SsdStore& s, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        return RowsAndFound<uint8_t>(n, s.row_bytes(),
                                     [&, k = k, n = n](uint8_t* out, uint8_t* flags) { s.Get(k, n, out, flags); });
      }, py::arg("keys"))
      .def("commit", [](hps::SsdStore& s) {
        py::gil_scoped_release release;
        s.Commit();
      })
      .def("compact", [](hps::SsdStore& s) {
        py::gil_scoped_release release;
        s.Compact();
      })
      .def("wait_for_compaction", [](hps::SsdStore& s) {
        py::gil_scoped_release release;
        s.WaitForCompaction();
      })
      .def("stats", [](const hps::SsdStore& s) {
        const hps::SsdStoreStats st = s.stats();
        py::dict d;
        d["files"] = st.files;
        d["live_records"] = st.live_records;
        d["stale_records"] = st.stale_records;
        d["disk_bytes"] = st.disk_bytes;
        d["rows_written"] = st.rows_written;
        d["bytes_written"] = st.bytes_written;
        d["rows_read"] = st.rows_read;
        d["bytes_read"] = st.bytes_read;
        d["bytes_requested"] = st.bytes_requested;
        d["commits"] = st.commits;
        d["compactions"] = st.compactions;
        d["compacted_records"] = st.compacted_records;
        d["compaction_failures"] = st.compaction_failures;
        d["cleanup_failures"] = st.cleanup_failures;
        d["manifest_rolls"] = st.manifest_rolls;
        d["manifest_roll_failures"] = st.manifest_roll_failures;
        d["last_error"] = st.last_error;
        d["corrupt_files"] = st.corrupt_files;
        d["unreadable_files"] = st.unreadable_files;
        d["compaction_running"] = st.compaction_running;
        d["compaction_lock_max_us"] = st.compaction_lock_max_us;
        d["index_bytes"] = st.index_bytes;
        d["io_path"] = st.io_path;
        d["io_fallback"] = st.io_fallback;
        d["stamp"] = st.stamp;
        d["bound_expired"] = st.bound_expired;
        d["bound_capped"] = st.bound_capped;
        d["bound_files_dropped"] = st.bound_files_dropped;
        d["bound_records_rewritten"] = st.bound_records_rewritten;
        return d;
      })
      .def_property_readonly("stamp", &hps::SsdStore::stamp)
      .def("set_stamp", &hps::SsdStore::SetStamp, py::arg("stamp"))
      .def("stamps", [](const hps::SsdStore& s, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<uint64_t> stamps(static_cast<py::ssize_t>(n));
        py::array_t<bool> found(static_cast<py::ssize_t>(n));
        uint64_t* out = stamps.mutable_data();
        uint8_t* f = Bytes(found);
        {
          py::gil_scoped_release release;
          s.Stamps(k, n, out, f);
        }
        return py::make_tuple(stamps, found);
      }, py::arg("keys"))
      .def("bound", [](hps::SsdStore& s, uint64_t min_stamp, uint64_t max_live) {
        hps::SsdBoundResult r;
        {
          py::gil_scoped_release release;
          r = s.Bound(min_stamp, max_live);
        }
        auto array = [](const std::vector<uint64_t>& v) {
          py::array_t<uint64_t> a(static_cast<py::ssize_t>(v.size()));
          if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(uint64_t));
          return a;
        };
        py::dict d;
        d["expired"] = array(r.expired);
        d["capped"] = array(r.capped);
        d["files_dropped"] = r.files_dropped;
        d["records_rewritten"] = r.records_rewritten;
        return d;
      }, py::arg("min_stamp"), py::arg("max_live"));

  py::class_<hps::BackingStore>(m, "BackingStore")
      .def(py::init([](hps::SsdStore& ssd, const hps::SparseOptimizer& optimizer, uint64_t write_buffer_rows) {
             return std::make_unique<hps::BackingStore>(&ssd, optimizer, write_buffer_rows);
           }),
           py::arg("ssd"), py::arg("optimizer"), py::arg("write_buffer_rows"),
           py::keep_alive<1, 2>())  // the SSD-PS it reads and writes
      .def_property_readonly("row_bytes", &hps::BackingStore::row_bytes)
      .def("load", [](hps::BackingStore& b, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        hps::CheckKeys(k, n);
        py::array_t<uint8_t> rows({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(b.row_bytes())});
        uint8_t* out = rows.mutable_data();
        {
          py::gil_scoped_release release;
          b.Load(k, n, out, nullptr);
        }
        return rows;
      }, py::arg("keys"))
      .def("sink", [](hps::BackingStore& b, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        hps::CheckKeys(k, n);
        const uint8_t* r = ByteRowsArg(rows, "rows", n, b.row_bytes());
        py::gil_scoped_release release;
        b.Sink(k, n, r);
      }, py::arg("keys"), py::arg("rows"))
      .def("flush", [](hps::BackingStore& b) {
        py::gil_scoped_release release;
        b.Flush();
      })
      .def("counts", [](const hps::BackingStore& b) {
        const hps::BackingStoreCounts c = b.counts();
        py::dict d;
        d["rows_loaded"] = c.rows_loaded;
        d["pending_hits"] = c.pending_hits;
        d["ssd_hits"] = c.ssd_hits;
        d["initialized"] = c.initialized;
        d["puts"] = c.puts;
        d["rows_put"] = c.rows_put;
        d["pending_rows"] = c.pending_rows;
        return d;
      });

  py::register_exception<hps::CacheFullError>(m, "CacheFullError", hps_error.ptr());
  m.attr("CACHE_POLICIES") = hps::CachePolicyNames();
  py::class_<hps::MemCache>(m, "MemCache")
      .def(py::init([](uint32_t row_bytes, uint64_t capacity, const std::string& policy, uint32_t shards,
                       double lru_fraction, py::object loader, py::object sink, bool huge_pages,
                       bool prefault, uint64_t lookahead_room) {
             hps::MemCacheOptions o;
             o.row_bytes = row_bytes;
             o.capacity = capacity;
             o.policy = hps::ParseCachePolicy(policy);
             o.shards = shards;
             o.lru_fraction = lru_fraction;
             o.huge_pages = huge_pages;
             o.prefault = prefault;
             o.lookahead_room = lookahead_room;
             return hps::MemCache::New(o, LoaderArg(std::move(loader), row_bytes),
                                       SinkArg(std::move(sink), row_bytes));
           }),
           py::arg("row_bytes"), py::arg("capacity"), py::arg("policy") = "lru+lfu", py::arg("shards") = 0,
           py::arg("lru_fraction") = 0.5, py::arg("loader") = py::none(), py::arg("sink") = py::none(),
           py::arg("huge_pages") = true, py::arg("prefault") = false, py::arg("lookahead_room") = 0,
           py::keep_alive<1, 7>(),
           py::keep_alive<1, 8>())  // a BackingStore lives as long as the cache
      .def_static("capacity_for_budget", &hps::MemCache::CapacityForBudget, py::arg("budget_bytes"),
                  py::arg("row_bytes"))
      .def_static("lookahead_base_room", &hps::MemCache::LookaheadBaseRoom, py::arg("capacity"),
                  py::arg("shards") = 0)
      .def_static("lookahead_window_room", &hps::MemCache::LookaheadWindowRoom, py::arg("batch_keys"),
                  py::arg("batches"), py::arg("capacity"), py::arg("shards") = 0)
      .def_property_readonly_static("UNBOUNDED_ROOM", [](py::object) { return hps::MemCache::kUnboundedRoom; })
      .def_property_readonly("row_bytes", &hps::MemCache::row_bytes)
      .def("pull", [](hps::MemCache& c, const py::array& keys, bool pin) {
        const auto [k, n] = KeysArg(keys, "keys");
        return RowsAndFound<uint8_t>(n, c.row_bytes(), [&, k = k, n = n](uint8_t* out, uint8_t* hit) {
          c.Pull(k, n, out, pin, hit);
        });
      }, py::arg("keys"), py::arg("pin") = false)
      .def("pin", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<bool> hit(static_cast<py::ssize_t>(n));
        uint8_t* h = Bytes(hit);
        {
          py::gil_scoped_release release;
          c.Pull(k, n, nullptr, /*pin=*/true, h);
        }
        return hit;
      }, py::arg("keys"), "pull(keys, pin=True) without the copy of the rows: returns the hit mask")
      .def("pin_rows", [](py::object self, const py::array& keys) {
        hps::MemCache& c = self.cast<hps::MemCache&>();
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<bool> hit(static_cast<py::ssize_t>(n));
        uint8_t* h = Bytes(hit);
        auto addresses = std::make_unique<RowAddresses>();
        addresses->cache = self;
        addresses->rows.resize(n);
        {
          py::gil_scoped_release release;
          c.Pin(k, n, h, addresses->rows.data());
        }
        return py::make_tuple(hit, py::cast(std::move(addresses)));
      }, py::arg("keys"), "pin(keys), and where the rows are (for HostBatch): (hit mask, RowAddresses)")
      .def("write_back", [](hps::MemCache& c, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        const uint8_t* r = ByteRowsArg(rows, "rows", n, c.row_bytes());
        py::gil_scoped_release release;
        c.WriteBack(k, n, r);
      }, py::arg("keys"), py::arg("rows"))
      .def("keep_updated", [](hps::MemCache& c, const py::array& keys, const py::array& rows) {
        const auto [k, n] = KeysArg(keys, "keys");
        const uint8_t* r = ByteRowsArg(rows, "rows", n, c.row_bytes());
        // It takes the miss lock, which a pull holds while its Python loader waits for the GIL.
        py::gil_scoped_release release;
        c.KeepUpdated(k, n, r);
      }, py::arg("keys"), py::arg("rows"),
           "newest rows of keys, pinned or not: dirty where cached, else to the sink; see hps.MemCache.keep_updated")
      .def("unpin", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::gil_scoped_release release;
        c.Unpin(k, n);
      }, py::arg("keys"))
      .def("access", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<bool> hit(static_cast<py::ssize_t>(n));
        uint8_t* h = Bytes(hit);
        {
          py::gil_scoped_release release;
          c.Access(k, n, h);
        }
        return hit;
      }, py::arg("keys"))
      .def("erase", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::gil_scoped_release release;
        return c.Erase(k, n);
      }, py::arg("keys"))
      .def("flush_dirty", [](hps::MemCache& c) {
        py::gil_scoped_release release;
        c.FlushDirty();
      })
      .def("read_pinned", [](const hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<uint8_t> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(c.row_bytes())});
        uint8_t* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          c.ReadPinned(k, n, o);
        }
        return out;
      }, py::arg("keys"))
      .def("set_lookahead", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::gil_scoped_release release;
        c.SetLookahead(k, n);
      }, py::arg("keys"),
           "the keys of the coming batches, in the order they will be needed; see hps.MemCache.set_lookahead")
      .def("push_lookahead", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::gil_scoped_release release;
        c.PushLookahead(k, n);
      }, py::arg("keys"), "one batch's keys at the lookahead window's end; see hps.MemCache.slide_lookahead")
      .def("pop_lookahead", [](hps::MemCache& c) {
        py::gil_scoped_release release;
        c.PopLookahead();
      }, "drops the lookahead window's first batch; see hps.MemCache.slide_lookahead")
      .def("slide_lookahead", [](hps::MemCache& c, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::gil_scoped_release release;
        c.SlideLookahead(k, n);
      }, py::arg("keys"), "push_lookahead(keys) then pop_lookahead(), in one change; see hps.MemCache.slide_lookahead")
      .def("clear_lookahead", [](hps::MemCache& c) {
        py::gil_scoped_release release;
        c.ClearLookahead();
      }, "back to eviction without lookahead")
      .def_property_readonly_static("LOOKAHEAD_SCAN", [](py::object) { return hps::MemCache::kLookaheadScan; })
      // Both take the shard locks, which a pull holds while its loader (Python) waits
      // for the GIL: holding the GIL here would deadlock against a pull in another thread.
      .def("__contains__", [](const hps::MemCache& c, uint64_t key) {
        py::gil_scoped_release release;
        return c.Contains(key);
      })
      .def("stats", [](const hps::MemCache& c) {
        hps::MemCacheStats st;
        {
          py::gil_scoped_release release;
          st = c.stats();
        }
        py::dict d;
        d["capacity"] = st.capacity;
        d["size"] = st.size;
        d["pinned"] = st.pinned;
        d["dirty"] = st.dirty;
        d["hits"] = st.hits;
        d["misses"] = st.misses;
        d["evictions"] = st.evictions;
        d["dirty_evictions"] = st.dirty_evictions;
        d["rows_loaded"] = st.rows_loaded;
        d["rows_flushed"] = st.rows_flushed;
        d["failed_releases"] = st.failed_releases;
        d["shards"] = st.shards;
        d["arena_bytes"] = st.arena_bytes;
        d["numa_nodes"] = st.numa_nodes;
        d["lookahead_keys"] = st.lookahead_keys;
        d["lookahead_spared"] = st.lookahead_spared;
        d["lookahead_forced"] = st.lookahead_forced;
        d["lookahead_slides"] = st.lookahead_slides;
        d["lookahead_bytes"] = st.lookahead_bytes;
        d["lookahead_room"] = st.lookahead_room;
        d["lookahead_no_room"] = st.lookahead_no_room;
        d["lookahead_visited"] = st.lookahead_visited;
        d["lookahead_skipped"] = st.lookahead_skipped;
        return d;
      });

  m.def("narrow_linear_forward", [](const py::array& x, const py::array& weight, const py::object& bias,
                                    const py::array& out, int threads) {
    const FloatRows in = FloatRowsArg(x, "x");
    const float* w = RowsArg(weight, "weight", static_cast<uint64_t>(weight.ndim() == 2 ? weight.shape(0) : 0),
                             in.columns);
    const int64_t outputs = weight.shape(0);
    const float* b = OptionalVectorArg(bias, "bias", outputs, false);
    if (!out.writeable()) throw py::value_error("out is read-only");
    float* o = const_cast<float*>(RowsArg(out, "out", static_cast<uint64_t>(in.rows), outputs));
    py::gil_scoped_release release;
    hps::NarrowLinearForward(in.data, in.rows, in.columns, in.stride, w, b, outputs, o, threads);
  }, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("threads") = 1,
     "out (rows, outputs) = x @ weight.T + bias, for at most 16 outputs (hps/narrow_linear.h)");

  m.def("narrow_linear_input_grad", [](const py::array& grad, const py::array& weight, int64_t columns,
                                       const py::array& out, int threads) {
    const FloatRows g = FloatRowsArg(grad, "grad");
    const FloatRows w = FloatRowsArg(weight, "weight");
    const FloatRows o = FloatRowsArg(out, "out");
    if (g.stride != g.columns || w.rows != g.columns || o.rows != g.rows || o.columns != columns) {
      throw py::value_error("narrow_linear_input_grad: grad (rows, outputs) contiguous, weight (outputs, >= columns) "
                            "and out (rows, columns); got grad " + ShapeOf(grad) + ", weight " + ShapeOf(weight) +
                            ", out " + ShapeOf(out) + ", columns " + std::to_string(columns));
    }
    if (!out.writeable()) throw py::value_error("out is read-only");
    py::gil_scoped_release release;
    hps::NarrowLinearInputGrad(g.data, g.rows, g.columns, w.data, w.stride, columns, o.data, o.stride, threads);
  }, py::arg("grad"), py::arg("weight"), py::arg("columns"), py::arg("out"), py::arg("threads") = 1,
     "out (rows, columns) = grad @ weight[:, :columns], for at most 16 outputs (hps/narrow_linear.h)");
  m.def("narrow_linear_weight_grad", [](const py::array& grad, const py::array& x, const py::array& grad_weight,
                                        const py::object& grad_bias, int threads) {
    const FloatRows g = FloatRowsArg(grad, "grad");
    const FloatRows in = FloatRowsArg(x, "x");
    const FloatRows gw = FloatRowsArg(grad_weight, "grad_weight");
    if (g.stride != g.columns || in.rows != g.rows || gw.rows != g.columns || gw.columns != in.columns ||
        gw.stride != gw.columns) {
      throw py::value_error("narrow_linear_weight_grad: grad (rows, outputs) contiguous, x (rows, inputs) and "
                            "grad_weight (outputs, inputs) contiguous; got grad " + ShapeOf(grad) + ", x " +
                            ShapeOf(x) + ", grad_weight " + ShapeOf(grad_weight));
    }
    if (!grad_weight.writeable()) throw py::value_error("grad_weight is read-only");
    float* gb = OptionalVectorArg(grad_bias, "grad_bias", g.columns, true);
    py::gil_scoped_release release;
    hps::NarrowLinearWeightGrad(g.data, g.rows, g.columns, in.data, in.columns, in.stride, gw.data, gb, threads);
  }, py::arg("grad"), py::arg("x"), py::arg("grad_weight"), py::arg("grad_bias"), py::arg("threads") = 1,
     "grad_weight (outputs, inputs) = grad.T @ x and grad_bias (outputs,) = grad.sum(0) in row order, for at most "
     "16 outputs (hps/narrow_linear.h)");
  m.attr("NARROW_LINEAR_MAX_OUTPUTS") = hps::kNarrowLinearMaxOutputs;
  m.def("narrow_linear_kernel", &hps::NarrowLinearKernel, "the version of the narrow linear kernels this CPU runs");

  m.def("unique_keys", [](const py::array& keys) {
    const auto [k, n] = KeysArg(keys, "keys");
    py::array_t<int64_t> inverse(static_cast<py::ssize_t>(n));
    int64_t* inv = inverse.mutable_data();
    std::vector<uint64_t> uniq;
    {
      py::gil_scoped_release release;
      uniq = hps::UniqueKeys(k, n, inv);
    }
    py::array_t<uint64_t> out(static_cast<py::ssize_t>(uniq.size()));
    if (!uniq.empty()) std::memcpy(out.mutable_data(), uniq.data(), uniq.size() * sizeof(uint64_t));  // no keys: null data
    return py::make_tuple(out, inverse);
  }, py::arg("keys"), "(distinct keys in order of first appearance, index of each key among them)");
  m.def("sum_by_inverse", [](const py::array& inverse, const py::array& rows, uint64_t n_unique) {
    const auto [inv, n] = PositionsArg(inverse, "inverse");
    if (rows.ndim() != 2) throw py::value_error("rows must be 2-D (n, width)");
    const int64_t width = rows.shape(1);
    const float* r = RowsArg(rows, "rows", n, width);
    return FilledRows(n_unique, width, [&, inv = inv, n = n](float* o) {
      hps::SumByInverse(inv, n, r, static_cast<int32_t>(width), n_unique, o);
    });
  }, py::arg("inverse"), py::arg("rows"), py::arg("n_unique"),
     "(n_unique, width) float32: row inverse[i] sums rows[i] (the gradients of unique_keys' keys)");

  // The native calls read and write rows of the tier's own width: a width
  // argument from Python that differs would size or read the arrays wrong.
  const auto check_width = [](const char* name, int32_t given, int32_t width) {
    if (given != width) {
      throw py::value_error(std::string(name) + " = " + std::to_string(given) + ", but the device tier's " + name +
                            " is " + std::to_string(width));
    }
  };
  py::class_<hps::DeviceTier>(m, "DeviceTier")
      .def(py::init([](int32_t devices, uint64_t capacity, const hps::SparseOptimizer& optimizer, bool use_cuda,
                       int32_t threads, const TierRoutesHandle* routes, const std::vector<int32_t>& cuda_devices,
                       bool bind_host_rows, bool track_trained) {
             return hps::DeviceTier::New({devices, capacity, optimizer, use_cuda, threads,
                                          routes ? routes->routes : nullptr, cuda_devices, bind_host_rows,
                                          track_trained});
           }),
           py::arg("devices"), py::arg("capacity"), py::arg("optimizer"), py::arg("use_cuda") = true,
           py::arg("threads") = 0, py::arg("routes") = nullptr, py::arg("cuda_devices") = std::vector<int32_t>{},
           py::arg("bind_host_rows") = true, py::arg("track_trained") = false)
      .def_property_readonly("binds_host_rows", &hps::DeviceTier::binds_host_rows)
      .def_property_readonly("devices", &hps::DeviceTier::devices)
      .def_property_readonly("row_floats", &hps::DeviceTier::row_floats)
      .def_property_readonly("dim", &hps::DeviceTier::dim)
      .def_property_readonly("kind", &hps::DeviceTier::kind)
      .def_property_readonly("accepts_gpu_memory", &hps::DeviceTier::accepts_gpu_memory)
      .def("__len__", &hps::DeviceTier::size)
      .def_static("modulo_owners", [](const py::array& keys, int32_t devices) {
        const auto [k, n] = KeysArg(keys, "keys");
        if (devices <= 0) throw py::value_error("devices must be > 0");
        py::array_t<int32_t> owners(static_cast<py::ssize_t>(n));
        int32_t* o = owners.mutable_data();
        for (uint64_t i = 0; i < n; ++i) o[i] = hps::DeviceTier::ModuloOwner(k[i], devices);
        return owners;
      }, py::arg("keys"), py::arg("devices"))
      .def("insert", [check_width](hps::DeviceTier& t, const py::array& keys, const py::array& rows,
                                   const py::object& owners, int32_t row_floats) {
        check_width("row_floats", row_floats, t.row_floats());
        const auto [k, n] = KeysArg(keys, "keys");
        const float* r = RowsArg(rows, "rows", n, row_floats);
        const int32_t* o = OwnersArg(owners, n);
        py::gil_scoped_release release;
        t.Insert(k, n, r, o);
      }, py::arg("keys"), py::arg("rows"), py::arg("owners"), py::arg("row_floats"))
      .def("assign", [check_width](hps::DeviceTier& t, const py::array& keys, const py::array& rows,
                                   const py::object& owners, int32_t row_floats) {
        check_width("row_floats", row_floats, t.row_floats());
        const auto [k, n] = KeysArg(keys, "keys");
        const float* r = RowsArg(rows, "rows", n, row_floats);
        const int32_t* o = OwnersArg(owners, n);
        py::gil_scoped_release release;
        return t.Assign(k, n, r, o);
      }, py::arg("keys"), py::arg("rows"), py::arg("owners"), py::arg("row_floats"))
      .def("get", [check_width](hps::DeviceTier& t, int32_t worker, const py::array& keys, const py::object& owners,
                                int32_t dim) {
        check_width("dim", dim, t.dim());
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        return FilledRows(n, dim, [&, k = k, n = n](float* e) { t.Get(worker, k, n, e, o); });
      }, py::arg("worker"), py::arg("keys"), py::arg("owners"), py::arg("dim"))
      .def("accumulate", [check_width](hps::DeviceTier& t, int32_t worker, const py::array& keys,
                                       const py::array& grads, const py::object& owners, int32_t dim) {
        check_width("dim", dim, t.dim());
        const auto [k, n] = KeysArg(keys, "keys");
        const float* g = RowsArg(grads, "grads", n, dim);
        const int32_t* o = OwnersArg(owners, n);
        py::gil_scoped_release release;
        t.Accumulate(worker, k, n, g, o);
      }, py::arg("worker"), py::arg("keys"), py::arg("grads"), py::arg("owners"), py::arg("dim"))
      .def("apply", [](hps::DeviceTier& t) {
        std::vector<uint64_t> updated;
        {
          py::gil_scoped_release release;
          updated = t.Apply();
        }
        py::array_t<uint64_t> keys(static_cast<py::ssize_t>(updated.size()));
        std::memcpy(keys.mutable_data(), updated.data(), updated.size() * sizeof(uint64_t));
        return keys;
      })
      .def("rows", [check_width](const hps::DeviceTier& t, const py::array& keys, const py::object& owners,
                                 int32_t row_floats) {
        check_width("row_floats", row_floats, t.row_floats());
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        return FilledRows(n, row_floats, [&, k = k, n = n](float* r) { t.Rows(k, n, r, o); });
      }, py::arg("keys"), py::arg("owners"), py::arg("row_floats"))
      .def("read_back", [check_width](const hps::DeviceTier& t, int32_t row_floats) {
        check_width("row_floats", row_floats, t.row_floats());
        const uint64_t n = t.size();
        py::array_t<uint64_t> keys(static_cast<py::ssize_t>(n));
        py::array_t<float> rows = NewRows(n, row_floats);
        uint64_t* k = keys.mutable_data();
        float* r = rows.mutable_data();
        uint64_t got;
        {
          py::gil_scoped_release release;
          got = t.ReadBack(k, r, n);
        }
        if (got != n) throw std::logic_error("device tier: read back fewer rows than it holds");
        return py::make_tuple(keys, rows);
      }, py::arg("row_floats"))
      .def_property_readonly("reads_in_place", &hps::DeviceTier::reads_in_place)
      .def("bind", [](hps::DeviceTier& t, const py::array& keys, const py::object& owners) {
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        py::gil_scoped_release release;
        t.Bind(k, n, o);
      }, py::arg("keys"), py::arg("owners"), "position i is (keys[i], owners[i]) until clear()")
      .def("get_at", &GetAtArg<hps::DeviceTier>, py::arg("worker"), py::arg("positions"), py::arg("out") = py::none(),
           kGetAtOut)
      .def("accumulate_at", &AccumulateAtArg<hps::DeviceTier>, py::arg("worker"), py::arg("positions"), py::arg("grads"),
           "grads: laid out as get_at's out")
      .def("copy_rows_at", [](hps::DeviceTier& t, const py::array& from, const py::array& to) {
        const auto [f, n] = PositionsArg(from, "from_positions");
        const auto [d, m] = PositionsArg(to, "to_positions");
        if (m != n) {
          throw py::value_error("copy_rows_at: from_positions has " + std::to_string(n) + " entries, to_positions " +
                                std::to_string(m));
        }
        py::gil_scoped_release release;
        t.CopyRowsAt(f, d, n);
      }, py::arg("from_positions"), py::arg("to_positions"))
      .def("clear", [](hps::DeviceTier& t) {
        py::gil_scoped_release release;
        t.Clear();
      })
      .def("trained", [](const hps::DeviceTier& t, const py::array& keys, const py::object& owners) {
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        py::array_t<bool> out(static_cast<py::ssize_t>(n));
        t.Trained(k, n, o, reinterpret_cast<uint8_t*>(out.mutable_data()));
        return out;
      }, py::arg("keys"), py::arg("owners"), "(n,) bool: whether each key's row on its owner is trained since "
                                               "it was last written below the tier")
      .def("set_trained", [](hps::DeviceTier& t, const py::array& keys, const py::object& owners, bool trained) {
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        py::gil_scoped_release release;
        t.SetTrained(k, n, o, trained);
      }, py::arg("keys"), py::arg("owners"), py::arg("trained"))
      .def("rows_trained", [check_width](const hps::DeviceTier& t, const py::array& keys, const py::object& owners,
                                         int32_t row_floats) {
        check_width("row_floats", row_floats, t.row_floats());
        const auto [k, n] = KeysArg(keys, "keys");
        const int32_t* o = OwnersArg(owners, n);
        py::array_t<bool> trained(static_cast<py::ssize_t>(n));
        auto* bits = reinterpret_cast<uint8_t*>(trained.mutable_data());
        py::array rows = FilledRows(n, row_floats, [&, k = k, n = n](float* r) { t.RowsTrained(k, n, o, r, bits); });
        return py::make_tuple(rows, trained);
      }, py::arg("keys"), py::arg("owners"), py::arg("row_floats"),
         "(rows (n, row_floats), trained (n,) bool): rows() and trained() with one lookup a key")
      .def("upsert", [check_width](hps::DeviceTier& t, const py::array& keys, const py::array& rows,
                                   const py::object& owners, int32_t row_floats, const py::object& trained) {
        check_width("row_floats", row_floats, t.row_floats());
        const auto [k, n] = KeysArg(keys, "keys");
        const float* r = RowsArg(rows, "rows", n, row_floats);
        const int32_t* o = OwnersArg(owners, n);
        const uint8_t* b = nullptr;
        if (!trained.is_none()) {
          const py::array a = py::array::ensure(trained);
          if (!a || !HasDtype<bool>(a) || a.ndim() != 1 || static_cast<uint64_t>(a.shape(0)) != n) {
            throw py::type_error("trained must be None or a 1-D bool array with one entry a key (" +
                                 std::to_string(n) + ")");
          }
          RequireContiguous(a, "trained");
          b = static_cast<const uint8_t*>(a.data());
        }
        py::gil_scoped_release release;
        t.Upsert(k, n, r, o, b);
      }, py::arg("keys"), py::arg("rows"), py::arg("owners"), py::arg("row_floats"), py::arg("trained") = py::none(),
         "assign, insert and set_trained in one call: each row written onto its owner (overwritten where loaded), "
         "its trained bit trained[i] (None: cleared)")
      .def("take_trained", [](hps::DeviceTier& t) {
        std::vector<uint64_t> keys;
        std::vector<int32_t> owners;
        {
          py::gil_scoped_release release;
          t.TakeTrained(&keys, &owners);
        }
        py::array_t<uint64_t> k(static_cast<py::ssize_t>(keys.size()));
        py::array_t<int32_t> o(static_cast<py::ssize_t>(owners.size()));
        std::memcpy(k.mutable_data(), keys.data(), keys.size() * sizeof(uint64_t));
        std::memcpy(o.mutable_data(), owners.data(), owners.size() * sizeof(int32_t));
        return py::make_tuple(k, o);
      }, "(keys, owners): every row whose trained bit is set; the bits are cleared")
      .def("set_gradient_capacity", [](hps::DeviceTier& t, int32_t device, uint64_t capacity) {
        py::gil_scoped_release release;
        t.SetGradientCapacity(device, capacity);
      }, py::arg("device"), py::arg("capacity"))
      .def("transfers", [](const hps::DeviceTier& t) {
        const hps::TransferMatrix m = t.transfers();
        const auto g = static_cast<py::ssize_t>(m.devices);
        py::array_t<uint64_t> rows({g, g}), bytes({g, g});
        std::memcpy(rows.mutable_data(), m.rows.data(), m.rows.size() * sizeof(uint64_t));
        std::memcpy(bytes.mutable_data(), m.bytes.data(), m.bytes.size() * sizeof(uint64_t));
        return py::make_tuple(rows, bytes);
      })
      .def("link_counters", [](const hps::DeviceTier& t) {
        // rows, bytes: (2, links, 2) [phase][link][a->b, b->a]; None without routes.
        const hps::LinkCounters c = t.link_counters();
        if (c.links == 0 && c.route_rows.empty()) return py::object(py::none());
        const auto l = static_cast<py::ssize_t>(c.links);
        py::array_t<uint64_t> rows({py::ssize_t{2}, l, py::ssize_t{2}}), bytes({py::ssize_t{2}, l, py::ssize_t{2}});
        std::memcpy(rows.mutable_data(), c.rows.data(), c.rows.size() * sizeof(uint64_t));
        std::memcpy(bytes.mutable_data(), c.bytes.data(), c.bytes.size() * sizeof(uint64_t));
        py::dict d;
        d["rows"] = rows;
        d["bytes"] = bytes;
        py::dict by_kind;
        for (int k = 1; k < 4; ++k) by_kind[hps::RouteKindName(static_cast<hps::RouteKind>(k))] = c.route_rows[k];
        d["route_rows"] = by_kind;
        d["relayed_rows"] = c.relayed_rows;
        d["relayed_bytes"] = c.relayed_bytes;
        return py::object(d);
      })
      .def("reset_transfers", &hps::DeviceTier::ResetTransfers);

  py::class_<RowAddresses>(m, "RowAddresses")
      .def("__len__", [](const RowAddresses& a) { return a.rows.size(); });
  py::class_<hps::HostBatch>(m, "HostBatch")
      .def(py::init([](hps::MemCache& cache, const py::array& keys, const hps::SparseOptimizer& optimizer,
                       const RowAddresses* addresses) {
             const auto [k, n] = KeysArg(keys, "keys");
             if (addresses != nullptr && addresses->rows.size() != n) {
               throw py::value_error("addresses: " + std::to_string(addresses->rows.size()) +
                                     " rows for " + std::to_string(n) + " keys");
             }
             if (addresses != nullptr && !addresses->cache.is(py::cast(&cache))) {
               throw py::value_error("addresses: from another MEM-PS cache");
             }
             py::gil_scoped_release release;
             if (addresses == nullptr) return std::make_unique<hps::HostBatch>(cache, k, n, optimizer);
             return std::make_unique<hps::HostBatch>(cache, k, n, addresses->rows.data(), optimizer);
           }),
           py::arg("cache"), py::arg("keys"), py::arg("optimizer"), py::arg("addresses") = nullptr,
           py::keep_alive<1, 2>(), "addresses: from cache.pin_rows(keys), the same keys")
      .def("__len__", &hps::HostBatch::size)
      .def("positions", [](const hps::HostBatch& b, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
        int64_t* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          b.Positions(k, n, o);
        }
        return out;
      }, py::arg("keys"))
      .def_property_readonly("dim", &hps::HostBatch::dim)
      .def("get", [](const hps::HostBatch& b, const py::array& positions, const py::object& out) -> py::object {
        const auto [p, n] = PositionsArg(positions, "positions");
        if (out.is_none()) return FilledRows(n, b.dim(), [&, p = p, n = n](float* o) { b.Get(p, n, o); });
        const LaidOutRows rows = LaidOutRowsArg(out.cast<py::array>(), "out", n, b.dim(), true);
        {
          py::gil_scoped_release release;
          b.Get(p, n, rows.data, rows.layout);
        }
        return out;
      }, py::arg("positions"), py::arg("out") = py::none(),
         "out: where to write (see accumulate's grads for the shapes it may have)")
      .def("accumulate", [](hps::HostBatch& b, const py::array& positions, const py::array& grads) {
        const auto [p, n] = PositionsArg(positions, "positions");
        const LaidOutRows rows = LaidOutRowsArg(grads, "grads", n, b.dim(), false);
        py::gil_scoped_release release;
        b.Accumulate(p, n, rows.data, rows.layout);
      }, py::arg("positions"), py::arg("grads"),
         "grads: (n, dim), or (B, k * dim) with B * k = n, possibly the first columns of a wider matrix")
      .def("apply", [](hps::HostBatch& b) {
        py::gil_scoped_release release;
        return b.Apply();
      })
      .def("rows", [](const hps::HostBatch& b, const py::array& positions) {
        const auto [p, n] = PositionsArg(positions, "positions");
        return FilledRows(n, b.row_floats(), [&, p = p, n = n](float* o) { b.Rows(p, n, o); });
      }, py::arg("positions"))
      .def("updated_keys", [](const hps::HostBatch& b) {
        const std::vector<uint64_t> keys = b.UpdatedKeys();
        py::array_t<uint64_t> out(static_cast<py::ssize_t>(keys.size()));
        std::memcpy(out.mutable_data(), keys.data(), keys.size() * sizeof(uint64_t));
        return out;
      })
      .def("release", [](hps::HostBatch& b) {
        py::gil_scoped_release release;
        b.Release();
      });

  py::class_<hps::WorkingSet>(m, "WorkingSet")
      .def_static("pin", [](const py::object& cache_object, const py::array& keys,
                            const hps::SparseOptimizer& optimizer, int32_t devices) {
        hps::MemCache& cache = cache_object.cast<hps::MemCache&>();
        const auto [k, n] = KeysArg(keys, "keys");
        std::unique_ptr<hps::WorkingSet> ws;
        {
          py::gil_scoped_release release;
          ws = std::make_unique<hps::WorkingSet>(cache, optimizer, devices, k, n);
        }
        py::array_t<uint64_t> uniq(static_cast<py::ssize_t>(ws->size()));
        std::memcpy(uniq.mutable_data(), ws->keys().data(), ws->size() * sizeof(uint64_t));
        py::array_t<int64_t> inverse(static_cast<py::ssize_t>(n));
        std::memcpy(inverse.mutable_data(), ws->inverse().data(), n * sizeof(int64_t));
        const uint64_t hits = ws->hits(), most = ws->most_per_device();
        py::object held = py::cast(std::move(ws));
        py::detail::keep_alive_impl(held, cache_object);  // the cache outlives its pins' holder
        return py::make_tuple(held, uniq, inverse, hits, most);
      }, py::arg("cache"), py::arg("keys"), py::arg("optimizer"), py::arg("devices"),
         "pins the distinct keys of keys: (WorkingSet, distinct keys, inverse, MEM-PS hits, most keys a device owns)")
      .def("__len__", &hps::WorkingSet::size)
      .def("set_owners", [](hps::WorkingSet& w, const py::array& owners) {
        const int32_t* o = OwnersArg(owners, w.size());
        w.SetOwners(o);
        return w.most_per_device();
      }, py::arg("owners"), "owners of the distinct keys; returns the most keys a device owns")
      .def("load", [](hps::WorkingSet& w, hps::DeviceTier& tier, const hps::WorkingSet* previous) {
        std::shared_ptr<hps::WorkingSet::Updates> updates = previous ? previous->updates() : nullptr;
        py::gil_scoped_release release;
        w.Load(tier, std::move(updates));
      }, py::arg("tier"), py::arg("previous") = nullptr, py::keep_alive<1, 2>(),
         "previous: the working set loaded before this one, if not yet written back")
      .def("get", [](hps::WorkingSet& w, int32_t worker, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        return FilledRows(n, w.dim(), [&, k = k, n = n](float* e) { w.Get(worker, k, n, e); });
      }, py::arg("worker"), py::arg("keys"))
      .def("accumulate", [](hps::WorkingSet& w, int32_t worker, const py::array& keys, const py::array& grads) {
        const auto [k, n] = KeysArg(keys, "keys");
        const float* g = RowsArg(grads, "grads", n, w.dim());
        py::gil_scoped_release release;
        w.Accumulate(worker, k, n, g);
      }, py::arg("worker"), py::arg("keys"), py::arg("grads"))
      .def("positions", [](const hps::WorkingSet& w, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
        int64_t* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          w.Positions(k, n, o);
        }
        return out;
      }, py::arg("keys"))
      .def_property_readonly("reads_in_place", &hps::WorkingSet::reads_in_place)
      .def("get_at", &GetAtArg<hps::WorkingSet>, py::arg("worker"), py::arg("positions"), py::arg("out") = py::none(),
           kGetAtOut)
      .def("accumulate_at", &AccumulateAtArg<hps::WorkingSet>, py::arg("worker"), py::arg("positions"), py::arg("grads"),
           "grads: laid out as get_at's out")
      // A tensor's memory by address (torch's data_ptr): the caller vouches for
      // (len(positions), dim) contiguous float32 there, on the host or (on_gpu)
      // on the worker's GPU.
      .def("get_into", [](hps::WorkingSet& w, int32_t worker, const py::array& positions, uintptr_t address,
                          bool on_gpu) {
        const auto [p, n] = PositionsArg(positions, "positions");
        py::gil_scoped_release release;
        w.GetAt(worker, p, n, reinterpret_cast<float*>(address), {}, MemoryArg(on_gpu));
      }, py::arg("worker"), py::arg("positions"), py::arg("address"), py::arg("on_gpu"))
      .def("accumulate_from", [](hps::WorkingSet& w, int32_t worker, const py::array& positions, uintptr_t address,
                                 bool on_gpu) {
        const auto [p, n] = PositionsArg(positions, "positions");
        py::gil_scoped_release release;
        w.AccumulateAt(worker, p, n, reinterpret_cast<const float*>(address), {}, MemoryArg(on_gpu));
      }, py::arg("worker"), py::arg("positions"), py::arg("address"), py::arg("on_gpu"))
      .def("apply", [](hps::WorkingSet& w) {
        py::gil_scoped_release release;
        return w.Apply();
      })
      .def("updated_keys", [](const hps::WorkingSet& w) {
        const std::vector<uint64_t>& keys = w.updated_keys();
        py::array_t<uint64_t> out(static_cast<py::ssize_t>(keys.size()));
        std::memcpy(out.mutable_data(), keys.data(), keys.size() * sizeof(uint64_t));
        return out;
      })
      .def("write_back", [](hps::WorkingSet& w) {
        py::gil_scoped_release release;
        w.WriteBack();
      })
      .def("abort", [](hps::WorkingSet& w) {
        py::gil_scoped_release release;
        w.Abort();
      })
      .def_property_readonly("released", &hps::WorkingSet::released);

  // Herald's scheduler (hps/herald.h); hps.herald.Herald is its Python face.
  py::class_<hps::Herald>(m, "Herald")
      .def(py::init([](int32_t workers, uint64_t capacity, bool location_aware, bool on_demand, double example_cost) {
             return std::make_unique<hps::Herald>(
                 hps::HeraldOptions{workers, capacity, location_aware, on_demand, example_cost});
           }), py::arg("workers"), py::arg("capacity"), py::arg("location_aware"), py::arg("on_demand"),
           py::arg("example_cost") = 0.0)
      .def("schedule", [](hps::Herald& h, const py::array& offsets, const py::array& keys,
                          const py::object& upcoming, const py::object& origin) {
        const auto [o, n_offsets] = KeysArg(offsets, "offsets");
        const auto [k, n] = KeysArg(keys, "keys");
        const uint64_t* up = nullptr;
        uint64_t n_up = 0;
        if (!upcoming.is_none()) {
          if (!py::isinstance<py::array>(upcoming)) throw py::type_error("upcoming must be a numpy array or None");
          const Keys u = KeysArg(upcoming.cast<py::array>(), "upcoming");
          up = u.data;
          n_up = u.n;
        }
        if (n_offsets == 0) throw py::value_error("offsets must have n_examples + 1 entries, got 0");
        if (o[n_offsets - 1] != n) {
          throw py::value_error("offsets[-1] = " + std::to_string(o[n_offsets - 1]) + " but keys has " +
                                std::to_string(n) + " entries");
        }
        py::array_t<int32_t, py::array::c_style> from;
        if (!origin.is_none()) {
          from = origin.cast<py::array_t<int32_t, py::array::c_style>>();
          if (from.ndim() != 1 || static_cast<uint64_t>(from.size()) != n_offsets - 1) {
            throw py::value_error("origin must be (n_examples,) = (" + std::to_string(n_offsets - 1) + ",), got " +
                                  std::to_string(from.size()) + " entries");
          }
        }
        const int32_t* from_data = origin.is_none() ? nullptr : from.data();
        hps::HeraldPlan p;
        {
          py::gil_scoped_release release;
          p = h.Schedule(o, n_offsets - 1, k, up, n_up, from_data);
        }
        auto array = [](const auto& v) {
          using T = typename std::decay_t<decltype(v)>::value_type;
          py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
          if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
          return a;
        };
        py::dict d;
        d["assignment"] = array(p.assignment);
        d["fetch_offsets"] = array(p.fetch_offsets);
        d["fetch_keys"] = array(p.fetch_keys);
        d["fetch_from"] = array(p.fetch_from);
        d["comm_offsets"] = array(p.comm_offsets);
        d["comm_keys"] = array(p.comm_keys);
        d["evicted"] = array(p.evicted);
        d["lost_keys"] = array(p.lost_keys);
        d["lost_from"] = array(p.lost_from);
        for (auto [name, value] : {std::pair{"pulls", p.pulls}, {"peer_pulls", p.peer_pulls}, {"pushes", p.pushes},
                                   {"evict_pushes", p.evict_pushes}, {"shared", p.shared}, {"distinct", p.distinct},
                                   {"examples_moved", p.examples_moved}}) {
          d[name] = value;
        }
        return d;
      }, py::arg("offsets"), py::arg("keys"), py::arg("upcoming") = py::none(), py::arg("origin") = py::none(),
         "plans one batch (CSR offsets, keys; upcoming: the lookahead window, 1-D; origin: each example's "
         "worker, int32): a dict of arrays and counts")
      .def("cached", [](const hps::Herald& h, int32_t worker) {
        const std::vector<uint64_t> keys = h.Cached(worker);
        py::array_t<uint64_t> out(static_cast<py::ssize_t>(keys.size()));
        if (!keys.empty()) std::memcpy(out.mutable_data(), keys.data(), keys.size() * sizeof(uint64_t));
        return out;
      }, py::arg("worker"))
      .def("cached_by_worker", [](const hps::Herald& h) {
        std::vector<uint64_t> offsets;
        const std::vector<uint64_t> keys = h.CachedByWorker(offsets);
        py::array_t<uint64_t> k(static_cast<py::ssize_t>(keys.size()));
        py::array_t<uint64_t> o(static_cast<py::ssize_t>(offsets.size()));
        if (!keys.empty()) std::memcpy(k.mutable_data(), keys.data(), keys.size() * sizeof(uint64_t));
        std::memcpy(o.mutable_data(), offsets.data(), offsets.size() * sizeof(uint64_t));
        return py::make_tuple(k, o);
      }, "(keys, offsets): every worker's cached keys, worker w's at keys[offsets[w]:offsets[w + 1]]")
      .def("cached_count", &hps::Herald::cached, py::arg("worker"))
      .def_property_readonly("batches", &hps::Herald::batches)
      .def_property_readonly("memory_bytes", &hps::Herald::memory_bytes)
      .def("clear", &hps::Herald::Clear);

  // The admission sketch (hps/admission.h); hps.admission.AdmissionSketch is its Python face.
  py::class_<hps::AdmissionSketch>(m, "AdmissionSketch")
      .def(py::init([](uint64_t bytes, int32_t rows, int32_t threshold, uint64_t seed) {
             return std::make_unique<hps::AdmissionSketch>(hps::AdmissionOptions{bytes, rows, threshold, seed});
           }), py::arg("bytes"), py::arg("rows"), py::arg("threshold"), py::arg("seed"))
      .def("admit", [](hps::AdmissionSketch& s, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<bool> admitted(static_cast<py::ssize_t>(n));
        hps::AdmissionCounts c;
        {
          py::gil_scoped_release release;
          c = s.Admit(k, n, reinterpret_cast<uint8_t*>(admitted.mutable_data()));
        }
        return py::make_tuple(admitted, c.admitted, c.newly_admitted);
      }, py::arg("keys"), "counts keys, then marks each admitted: (bool mask, admitted, newly admitted)")
      .def("query", [](const hps::AdmissionSketch& s, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<bool> admitted(static_cast<py::ssize_t>(n));
        uint64_t yes;
        {
          py::gil_scoped_release release;
          yes = s.Query(k, n, reinterpret_cast<uint8_t*>(admitted.mutable_data()));
        }
        return py::make_tuple(admitted, yes);
      }, py::arg("keys"), "marks each key admitted, counting nothing: (bool mask, admitted)")
      .def("estimate", [](const hps::AdmissionSketch& s, const py::array& keys) {
        const auto [k, n] = KeysArg(keys, "keys");
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(n));
        uint8_t* o = out.mutable_data();
        for (uint64_t i = 0; i < n; ++i) o[i] = static_cast<uint8_t>(s.Estimate(k[i]));
        return out;
      }, py::arg("keys"))
      .def("counters", [](const hps::AdmissionSketch& s) {
        const std::vector<uint8_t>& c = s.counters();
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(c.size()));
        if (!c.empty()) std::memcpy(out.mutable_data(), c.data(), c.size());
        return out;
      }, "a copy of the counters, (rows * width,) uint8")
      .def("restore", [](hps::AdmissionSketch& s, const py::array& counters) {
        if (!HasDtype<uint8_t>(counters) || counters.ndim() != 1) {
          throw py::type_error("counters must be a 1-D uint8 array, got " + DtypeName(counters) + " " +
                               ShapeOf(counters));
        }
        RequireContiguous(counters, "counters");
        s.Restore(static_cast<const uint8_t*>(counters.data()), static_cast<uint64_t>(counters.shape(0)));
      }, py::arg("counters"))
      .def_property_readonly("width", &hps::AdmissionSketch::width)
      .def_property_readonly("bytes", [](const hps::AdmissionSketch& s) { return s.counters().size(); });

  // The router, cost model and host executor (hps/topology.h); hps.topology is
  // their Python face. A topology comes as plain lists: devices (name, kind,
  // numa) with kind 0 gpu, 1 host, 2 cpu, 3 switch; links (a, b, gbps,
  // latency_us, kind). bytes is the (E, E) uint64 transfer matrix.
  auto topo_of = [](const std::vector<std::tuple<std::string, int32_t, int32_t>>& devices,
                    const std::vector<std::tuple<int32_t, int32_t, double, double, std::string>>& links) {
    hps::Topology t;
    for (const auto& [name, kind, numa] : devices) {
      if (kind < 0 || kind > 3) throw py::value_error("device " + name + ": kind " + std::to_string(kind) + " is not 0-3");
      t.devices.push_back({name, static_cast<hps::DeviceKind>(kind), numa});
    }
    for (const auto& [a, b, gbps, us, kind] : links) t.links.push_back({a, b, gbps, us, kind});
    return t;
  };
  auto matrix_of = [](const py::array& a) {
    if (!HasDtype<uint64_t>(a)) throw py::type_error("bytes must be a uint64 array, got " + DtypeName(a));
    if (a.ndim() != 2 || a.shape(0) != a.shape(1)) throw py::value_error("bytes must be square (E, E), got " + ShapeOf(a));
    RequireContiguous(a, "bytes");
    const auto* p = static_cast<const uint64_t*>(a.data());
    return std::vector<uint64_t>(p, p + a.size());
  };
  auto schedule_of = [](const std::string& s) {
    if (s == "host") return hps::Schedule::kHost;
    if (s == "direct") return hps::Schedule::kDirect;
    if (s == "relay") return hps::Schedule::kRelay;
    throw py::value_error("schedule must be 'host', 'direct' or 'relay', got '" + s + "'");
  };
  auto plan_dict = [](const hps::RoutePlan& p) {
    py::list routes;
    for (const auto& r : p.routes) {
      if (r.kind == hps::RouteKind::kNone) continue;
      py::dict d;
      d["src"] = r.src;
      d["dst"] = r.dst;
      d["kind"] = hps::RouteKindName(r.kind);
      d["via"] = r.via;
      d["path"] = r.path;
      d["reason"] = r.reason;
      routes.append(d);
    }
    py::dict out;
    out["routes"] = routes;
    out["seconds"] = p.cost.seconds;
    out["phase_seconds"] = p.cost.phase_seconds;
    out["link_bytes"] = p.cost.link_bytes;
    py::dict count;
    for (int k = 0; k < 4; ++k) count[hps::RouteKindName(static_cast<hps::RouteKind>(k))] = p.cost.route_count[k];
    out["route_count"] = count;
    out["relayed_bytes"] = p.cost.relayed_bytes;
    out["hops"] = p.cost.hops;
    return out;
  };
  m.def("plan_routes", [=](const std::vector<std::tuple<std::string, int32_t, int32_t>>& devices,
                           const std::vector<std::tuple<int32_t, int32_t, double, double, std::string>>& links,
                           const py::array& bytes, const std::string& schedule) {
    return plan_dict(hps::PlanRoutes(topo_of(devices, links), matrix_of(bytes), schedule_of(schedule)));
  }, py::arg("devices"), py::arg("links"), py::arg("bytes"), py::arg("schedule"),
        "routes every endpoint pair with bytes under the schedule ('host', 'direct', 'relay') and models its time");
  m.def("fixed_routes", [=](const std::vector<std::tuple<std::string, int32_t, int32_t>>& devices,
                            const std::vector<std::tuple<int32_t, int32_t, double, double, std::string>>& links,
                            const py::array& bytes, const std::vector<int32_t>& via) {
    return plan_dict(hps::FixedRoutes(topo_of(devices, links), matrix_of(bytes), via));
  }, py::arg("devices"), py::arg("links"), py::arg("bytes"), py::arg("via"),
        "a fixed rule's routes and modelled time: via[s*E+d] the middleman of pair (s, d), -1 direct or host");
  m.def("execute_routes", [=](const std::vector<std::tuple<std::string, int32_t, int32_t>>& devices,
                              const std::vector<std::tuple<int32_t, int32_t, double, double, std::string>>& links,
                              const py::array& bytes, const std::string& schedule, const std::vector<py::array>& send,
                              std::vector<py::array> recv, const std::vector<int32_t>& gpus) {
    const std::vector<uint64_t> m8 = matrix_of(bytes);
    const size_t e = static_cast<size_t>(bytes.shape(0));
    if (send.size() != e || recv.size() != e)
      throw py::value_error("send and recv need " + std::to_string(e) + " buffers each, got " +
                            std::to_string(send.size()) + " and " + std::to_string(recv.size()));
    std::vector<const uint8_t*> sp;
    std::vector<uint8_t*> rp;
    for (size_t i = 0; i < e; ++i) {
      uint64_t out = 0, in = 0;
      for (size_t j = 0; j < e; ++j) out += m8[i * e + j], in += m8[j * e + i];
      for (auto [arr, need, name] : {std::tuple{&send[i], out, "send"}, std::tuple{static_cast<const py::array*>(&recv[i]), in, "recv"}}) {
        if (!HasDtype<uint8_t>(*arr) || !(arr->flags() & py::array::c_style) ||
            static_cast<uint64_t>(arr->nbytes()) != need)
          throw py::value_error(std::string(name) + "[" + std::to_string(i) + "] must be a contiguous uint8 array of " +
                                std::to_string(need) + " bytes, got " + DtypeName(*arr) + " " + ShapeOf(*arr));
      }
      sp.push_back(static_cast<const uint8_t*>(send[i].data()));
      if (!recv[i].writeable()) throw py::value_error("recv[" + std::to_string(i) + "] is read-only");
      rp.push_back(static_cast<uint8_t*>(recv[i].mutable_data()));
    }
    const hps::RoutePlan plan = hps::PlanRoutes(topo_of(devices, links), m8, schedule_of(schedule));
    hps::ExecStats st;
    {
      py::gil_scoped_release release;
      st = gpus.empty() ? hps::ExecuteOnHost(plan, m8, sp, rp) : hps::ExecuteOnCudaFromHost(plan, m8, gpus, sp, rp);
    }
    py::dict d;
    d["seconds"] = st.seconds;
    d["phase_seconds"] = st.phase_seconds;
    d["bytes_copied"] = st.bytes_copied;
    d["staged_bytes"] = st.staged_bytes;
    return d;
  }, py::arg("devices"), py::arg("links"), py::arg("bytes"), py::arg("schedule"), py::arg("send"), py::arg("recv"),
        py::arg("gpus") = std::vector<int32_t>{},
        "plans the schedule and runs it between host buffers (segments in endpoint order): with memcpy, or, "
        "given gpus (endpoint e on CUDA device gpus[e]), with the CUDA executor through copies on those GPUs");
  m.def("cuda_executor_available", &hps::CudaExecutorAvailable);

  py::class_<TierRoutesHandle>(m, "TierRoutes")
      .def(py::init([=](const std::vector<std::tuple<std::string, int32_t, int32_t>>& devices,
                        const std::vector<std::tuple<int32_t, int32_t, double, double, std::string>>& links,
                        int32_t tier_devices, uint64_t pair_bytes, bool execute) {
             return TierRoutesHandle{hps::PlanTierRoutes(topo_of(devices, links), tier_devices, pair_bytes, execute)};
           }),
           py::arg("devices"), py::arg("links"), py::arg("tier_devices"), py::arg("pair_bytes"), py::arg("execute"),
           "a run's routes for a device tier of tier_devices devices (endpoints 0..G-1 of the topology), planned "
           "for an even all-to-all of pair_bytes a pair; execute: the host executor moves the rows")
      .def_property_readonly("plan", [=](const TierRoutesHandle& h) { return plan_dict(h.routes->plan); })
      .def_property_readonly("execute", [](const TierRoutesHandle& h) { return h.routes->execute; })
      .def_property_readonly("devices", [](const TierRoutesHandle& h) { return h.routes->devices; });
}
