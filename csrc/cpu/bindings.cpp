// pybind11 bindings of the CPU kernels: module ``rfmem_fast._native``.
//
// Every function takes numpy arrays (zero-copy views of torch CPU tensors via
// ``tensor.numpy()``), checks dtype, rank, shape and C-contiguity and raises
// TypeError / ValueError with the argument's name on bad input (never a silent copy,
// never a crash), allocates the outputs, then releases the GIL around the compute.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"
#include "context.h"
#include "kernels.h"
#include "lexical.h"
#include "tokenize.h"
#include "recollect.h"

namespace py = pybind11;

namespace {

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a.shape(i));
  }
  if (a.ndim() == 1) s += ",";
  return s + ")";
}

// The object as a numpy array of dtype T, rank ndim, C-contiguous; raises otherwise.
template <typename T>
py::array checked(const py::object& obj, const char* fn, const char* name, py::ssize_t ndim,
                  const char* dtype_name) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(fn) + ": " + name + " must be a numpy.ndarray of dtype " +
                         dtype_name + " (pass tensor.numpy() for a CPU tensor), got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (!py::isinstance<py::array_t<T>>(a)) {
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype " + dtype_name +
                         ", got " + std::string(py::str(a.dtype())));
  }
  if (a.ndim() != ndim) {
    throw py::value_error(std::string(fn) + ": " + name + " must be " + std::to_string(ndim) +
                          "-D, got shape " + shape_str(a));
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(fn) + ": " + name +
                          " must be C-contiguous (use np.ascontiguousarray / tensor.contiguous())");
  }
  return a;
}

template <typename T>
const T* cptr(const py::array& a) {
  return static_cast<const T*>(a.data());
}

void check_threads(const char* fn, int num_threads) {
  if (num_threads < 0)
    throw py::value_error(std::string(fn) + ": num_threads must be >= 0 (0 = the machine's threads), got " +
                          std::to_string(num_threads));
}

struct TopkInputs {
  py::array X, offsets, Q, qseg;
  int64_t n, d, U, b;
};

TopkInputs check_topk(const char* fn, const py::object& X_, const py::object& offsets_,
                      const py::object& Q_, const py::object& qseg_, int64_t k) {
  TopkInputs in;
  in.X = checked<float>(X_, fn, "X", 2, "float32");
  in.offsets = checked<int64_t>(offsets_, fn, "offsets", 1, "int64");
  in.Q = checked<float>(Q_, fn, "Q", 2, "float32");
  in.qseg = checked<int64_t>(qseg_, fn, "qseg", 1, "int64");
  in.n = in.X.shape(0);
  in.d = in.X.shape(1);
  in.b = in.Q.shape(0);
  if (in.d < 1) throw py::value_error(std::string(fn) + ": X must have d >= 1 columns, got shape " + shape_str(in.X));
  if (in.Q.shape(1) != in.d)
    throw py::value_error(std::string(fn) + ": Q must be [b, " + std::to_string(in.d) + "] like X, got shape " +
                          shape_str(in.Q));
  if (in.qseg.shape(0) != in.b)
    throw py::value_error(std::string(fn) + ": qseg must have one entry per query (" + std::to_string(in.b) +
                          "), got shape " + shape_str(in.qseg));
  if (k < 1) throw py::value_error(std::string(fn) + ": k must be >= 1, got " + std::to_string(k));
  if (in.offsets.shape(0) < 1) throw py::value_error(std::string(fn) + ": offsets must hold U + 1 >= 1 entries");
  in.U = in.offsets.shape(0) - 1;
  const int64_t* off = cptr<int64_t>(in.offsets);
  if (off[0] < 0) throw py::value_error(std::string(fn) + ": offsets[0] must be >= 0, got " + std::to_string(off[0]));
  for (int64_t u = 0; u < in.U; ++u) {
    if (off[u + 1] < off[u])
      throw py::value_error(std::string(fn) + ": offsets must be non-decreasing (offsets[" + std::to_string(u + 1) +
                            "] = " + std::to_string(off[u + 1]) + " < offsets[" + std::to_string(u) +
                            "] = " + std::to_string(off[u]) + ")");
  }
  if (off[in.U] > in.n)
    throw py::value_error(std::string(fn) + ": offsets[-1] = " + std::to_string(off[in.U]) +
                          " exceeds the number of rows of X (" + std::to_string(in.n) + ")");
  const int64_t* seg = cptr<int64_t>(in.qseg);
  for (int64_t i = 0; i < in.b; ++i) {
    if (seg[i] < 0 || seg[i] >= in.U)
      throw py::value_error(std::string(fn) + ": qseg[" + std::to_string(i) + "] = " + std::to_string(seg[i]) +
                            " is not a segment index in [0, " + std::to_string(in.U) + ")");
  }
  return in;
}

// The options of a top-k call: the scan copy (checked against X), its type, the path.
struct ScanArg {
  py::array arr;   // keeps the scan copy alive while the GIL is released
  py::array meta;  // (the int8 copy's per-row data)
  rfmem::TopkOptions opt;
};

ScanArg check_scan(const char* fn, const TopkInputs& in, const py::object& scan_, const std::string& scan_type,
                   const std::string& path, int num_threads, double xnorm, const py::object& scan_meta_) {
  ScanArg s;
  s.opt.num_threads = num_threads;
  s.opt.xnorm = xnorm;
  if (path == "auto") s.opt.path = rfmem::TopkPath::kAuto;
  else if (path == "scan") s.opt.path = rfmem::TopkPath::kScan;
  else if (path == "gemm") s.opt.path = rfmem::TopkPath::kGemm;
  else throw py::value_error(std::string(fn) + ": path must be one of ('auto', 'scan', 'gemm'), got '" + path + "'");
  if (scan_type != "float32" && scan_type != "float16" && scan_type != "bfloat16" && scan_type != "int8")
    throw py::value_error(std::string(fn) + ": scan_type must be one of ('float32', 'float16', 'bfloat16', 'int8'), "
                          "got '" + scan_type + "'");
  if (scan_.is_none()) {
    if (scan_type != "float32")
      throw py::value_error(std::string(fn) + ": scan_type '" + scan_type + "' needs the scan copy (scan=None given)");
    if (!scan_meta_.is_none())
      throw py::value_error(std::string(fn) + ": scan_meta is the int8 copy's per-row data: give it with "
                            "scan_type='int8' and its scan");
    return s;
  }
  if (scan_type == "float32")
    throw py::value_error(std::string(fn) + ": a scan copy was given but scan_type is 'float32' (say 'float16', "
                          "'bfloat16' or 'int8')");
  if (scan_type == "int8") {
    s.arr = checked<int8_t>(scan_, fn, "scan", 2, "int8 (the int8 codes)");
    if (s.arr.shape(0) != in.n || s.arr.shape(1) != in.d)
      throw py::value_error(std::string(fn) + ": scan must have X's shape (" + std::to_string(in.n) + ", " +
                            std::to_string(in.d) + "), got " + shape_str(s.arr));
    if (scan_meta_.is_none())
      throw py::value_error(std::string(fn) + ": scan_type 'int8' needs scan_meta (float32 [n, 3]: scale, residual "
                            "norm bound, norm bound per row)");
    s.meta = checked<float>(scan_meta_, fn, "scan_meta", 2, "float32");
    if (s.meta.shape(0) != in.n || s.meta.shape(1) != 3)
      throw py::value_error(std::string(fn) + ": scan_meta must have shape (" + std::to_string(in.n) + ", 3), got " +
                            shape_str(s.meta));
    s.opt.scan_i8 = cptr<int8_t>(s.arr);
    s.opt.scan_meta = cptr<float>(s.meta);
    s.opt.scan_type = rfmem::ScanType::kI8;
    return s;
  }
  if (!scan_meta_.is_none())
    throw py::value_error(std::string(fn) + ": scan_meta is only for scan_type='int8'");
  s.arr = checked<uint16_t>(scan_, fn, "scan", 2, "uint16 (the float16 / bfloat16 bits)");
  if (s.arr.shape(0) != in.n || s.arr.shape(1) != in.d)
    throw py::value_error(std::string(fn) + ": scan must have X's shape (" + std::to_string(in.n) + ", " +
                          std::to_string(in.d) + "), got " + shape_str(s.arr));
  s.opt.scan = cptr<uint16_t>(s.arr);
  s.opt.scan_type = scan_type == "float16" ? rfmem::ScanType::kF16 : rfmem::ScanType::kBF16;
  return s;
}

// The row selections of a filtered call (kernels.h SelTable), checked: all six arrays or
// none; every selection's rows increasing inside its segment, its mask (mask mode)
// marking exactly them; each filtered query's selection in its own segment.
struct SelArg {
  py::array qsel, seg, off, rows, mask, mask_off;  // keep the arrays alive while the GIL is released
  rfmem::SelTable tab;
  const int64_t* q = nullptr;
};

void check_select(const char* fn, const TopkInputs& in, const py::object& qsel_, const py::object& seg_,
                  const py::object& off_, const py::object& rows_, const py::object& mask_,
                  const py::object& mask_off_, SelArg& s) {
  const int given = !qsel_.is_none() + !seg_.is_none() + !off_.is_none() + !rows_.is_none() + !mask_.is_none() +
                    !mask_off_.is_none();
  if (given == 0) return;
  if (given != 6)
    throw py::value_error(std::string(fn) + ": qsel, sel_seg, sel_off, sel_rows, sel_mask and sel_mask_off must be "
                          "given together (a filtered search) or not at all");
  s.qsel = checked<int64_t>(qsel_, fn, "qsel", 1, "int64");
  s.seg = checked<int64_t>(seg_, fn, "sel_seg", 1, "int64");
  s.off = checked<int64_t>(off_, fn, "sel_off", 1, "int64");
  s.rows = checked<int64_t>(rows_, fn, "sel_rows", 1, "int64");
  s.mask = checked<uint8_t>(mask_, fn, "sel_mask", 1, "uint8");
  s.mask_off = checked<int64_t>(mask_off_, fn, "sel_mask_off", 1, "int64");
  const int64_t P = s.seg.shape(0);
  if (s.qsel.shape(0) != in.b)
    throw py::value_error(std::string(fn) + ": qsel must have one entry per query (" + std::to_string(in.b) +
                          "), got shape " + shape_str(s.qsel));
  if (s.off.shape(0) != P + 1 || s.mask_off.shape(0) != P)
    throw py::value_error(std::string(fn) + ": sel_off must be [P + 1] and sel_mask_off [P] for P = " +
                          std::to_string(P) + " selections (sel_seg), got shapes " + shape_str(s.off) + " and " +
                          shape_str(s.mask_off));
  const int64_t* off = cptr<int64_t>(in.offsets);
  const int64_t* sseg = cptr<int64_t>(s.seg);
  const int64_t* so = cptr<int64_t>(s.off);
  const int64_t* sr = cptr<int64_t>(s.rows);
  const int64_t* smo = cptr<int64_t>(s.mask_off);
  const uint8_t* sm = static_cast<const uint8_t*>(s.mask.data());
  const int64_t M = s.rows.shape(0), nmask = s.mask.shape(0);
  if (so[0] != 0 || so[P] != M)
    throw py::value_error(std::string(fn) + ": sel_off must run from 0 to len(sel_rows) = " + std::to_string(M));
  for (int64_t p = 0; p < P; ++p) {
    const std::string where = std::string(fn) + ": selection " + std::to_string(p);
    if (sseg[p] < 0 || sseg[p] >= in.U) throw py::value_error(where + ": sel_seg is not a segment index");
    if (so[p + 1] < so[p]) throw py::value_error(std::string(fn) + ": sel_off must be non-decreasing");
    const int64_t a = off[sseg[p]], e = off[sseg[p] + 1];
    for (int64_t j = so[p]; j < so[p + 1]; ++j) {
      if (sr[j] < a || sr[j] >= e || (j > so[p] && sr[j] <= sr[j - 1]))
        throw py::value_error(where + ": sel_rows must increase inside the selection's segment [" +
                              std::to_string(a) + ", " + std::to_string(e) + ")");
    }
    if (smo[p] == -1) continue;
    if (smo[p] < 0 || smo[p] + (e - a) > nmask)
      throw py::value_error(where + ": sel_mask_off must be -1 (list mode) or an offset of its segment's mask inside "
                            "sel_mask");
    int64_t ones = 0;
    for (int64_t r = 0; r < e - a; ++r) ones += sm[smo[p] + r] != 0;
    bool same = ones == so[p + 1] - so[p];
    for (int64_t j = so[p]; same && j < so[p + 1]; ++j) same = sm[smo[p] + sr[j] - a] != 0;
    if (!same) throw py::value_error(where + ": sel_mask must mark exactly its sel_rows");
  }
  const int64_t* q = cptr<int64_t>(s.qsel);
  const int64_t* qseg = cptr<int64_t>(in.qseg);
  for (int64_t i = 0; i < in.b; ++i) {
    if (q[i] < -1 || q[i] >= P)
      throw py::value_error(std::string(fn) + ": qsel[" + std::to_string(i) + "] = " + std::to_string(q[i]) +
                            " is neither -1 nor a selection index in [0, " + std::to_string(P) + ")");
    if (q[i] >= 0 && sseg[q[i]] != qseg[i])
      throw py::value_error(std::string(fn) + ": qsel[" + std::to_string(i) + "] names a selection of segment " +
                            std::to_string(sseg[q[i]]) + " for a query of segment " + std::to_string(qseg[i]));
  }
  s.tab.n = P;
  s.tab.off = so;
  s.tab.rows = sr;
  s.tab.mask = sm;
  s.tab.mask_off = smo;
  s.q = q;
}

void apply_select(const SelArg& s, rfmem::TopkOptions& opt) {
  if (s.q == nullptr) return;
  opt.sel = &s.tab;
  opt.qsel = s.q;
}

py::tuple py_segmented_topk(const py::object& X_, const py::object& offsets_, const py::object& Q_,
                            const py::object& qseg_, int64_t k, int num_threads, double xnorm, const py::object& scan_,
                            const std::string& scan_type, const std::string& path, const py::object& qsel_,
                            const py::object& sel_seg_, const py::object& sel_off_, const py::object& sel_rows_,
                            const py::object& sel_mask_, const py::object& sel_mask_off_,
                            const py::object& scan_meta_) {
  const char* fn = "segmented_topk";
  check_threads(fn, num_threads);
  TopkInputs in = check_topk(fn, X_, offsets_, Q_, qseg_, k);
  ScanArg sa = check_scan(fn, in, scan_, scan_type, path, num_threads, xnorm, scan_meta_);
  SelArg sel;
  check_select(fn, in, qsel_, sel_seg_, sel_off_, sel_rows_, sel_mask_, sel_mask_off_, sel);
  apply_select(sel, sa.opt);
  py::array_t<float> scores({static_cast<py::ssize_t>(in.b), static_cast<py::ssize_t>(k)});
  py::array_t<int64_t> rows({static_cast<py::ssize_t>(in.b), static_cast<py::ssize_t>(k)});
  float* ps = scores.mutable_data();
  int64_t* pr = rows.mutable_data();
  {
    py::gil_scoped_release nogil;
    rfmem::segmented_topk(cptr<float>(in.X), in.n, in.d, cptr<int64_t>(in.offsets), in.U, cptr<float>(in.Q),
                          cptr<int64_t>(in.qseg), in.b, k, ps, pr, sa.opt);
  }
  return py::make_tuple(scores, rows);
}

rfmem::Entropy parse_convention(const char* fn, const std::string& c) {
  if (c == "mean") return rfmem::Entropy::kMean;
  if (c == "sum") return rfmem::Entropy::kSum;
  if (c == "normalized") return rfmem::Entropy::kNormalized;
  throw py::value_error(std::string(fn) + ": convention must be one of ('mean', 'sum', 'normalized'), got '" + c +
                        "'");
}

struct HitsArgs {
  py::array hptr, hrows, hx, hval;
};

// The lexical hits of b queries (bm25_hits' layout, plus their boosts hx), checked against
// the queries' segments: ascending local rows, finite boosts >= 0.
// The hits' CSR (hptr int64 [b + 1], hrows int32 [H]: ascending local rows of each query's
// segment), checked against the queries' segments.
void check_hit_rows(const char* fn, const TopkInputs& in, const py::object& hptr_, const py::object& hrows_,
                    HitsArgs& h) {
  h.hptr = checked<int64_t>(hptr_, fn, "hptr", 1, "int64");
  h.hrows = checked<int32_t>(hrows_, fn, "hrows", 1, "int32");
  const int64_t b = in.b;
  if (h.hptr.shape(0) != b + 1)
    throw py::value_error(std::string(fn) + ": hptr must have b + 1 entries, got shape " + shape_str(h.hptr));
  const int64_t H = h.hrows.shape(0);
  const int64_t* hp = cptr<int64_t>(h.hptr);
  const int64_t* off = cptr<int64_t>(in.offsets);
  const int64_t* seg = cptr<int64_t>(in.qseg);
  const int32_t* hr = cptr<int32_t>(h.hrows);
  if (hp[0] != 0 || hp[b] != H) throw py::value_error(std::string(fn) + ": hptr must run from 0 to len(hrows)");
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = off[seg[i] + 1] - off[seg[i]];
    if (hp[i + 1] < hp[i]) throw py::value_error(std::string(fn) + ": hptr must be non-decreasing");
    int64_t prev = -1;
    bool bad = false;  // (one test per query, not a branch per hit)
    for (int64_t j = hp[i]; j < hp[i + 1]; ++j) {
      bad |= hr[j] <= prev;
      prev = hr[j];
    }
    if (bad || prev >= len)
      throw py::value_error(std::string(fn) + ": hrows of query " + std::to_string(i) +
                            " must be ascending local rows of its segment");
  }
}

// The hits' boosts hx and BM25 hval (float64 [H] each, H = len(h.hrows); hx finite and >= 0) into h;
// hx None: hval alone (the boosts given as per-query factors).
void check_boosts(const char* fn, const py::object& hx_, const py::object& hval_, HitsArgs& h) {
  h.hval = checked<double>(hval_, fn, "hval", 1, "float64");
  const int64_t H = h.hrows.shape(0);
  if (hx_.is_none()) {
    if (h.hval.shape(0) != H) throw py::value_error(std::string(fn) + ": hval must have one entry per hrows entry");
    return;
  }
  h.hx = checked<double>(hx_, fn, "hx", 1, "float64");
  if (h.hx.shape(0) != H || h.hval.shape(0) != H)
    throw py::value_error(std::string(fn) + ": hx and hval must have one entry per hrows entry");
  const double* px = cptr<double>(h.hx);
  bool bad = false;  // (one test, not a branch per hit; the first bad entry looked up after)
  for (int64_t j = 0; j < H; ++j) bad |= !(px[j] >= 0.0 && px[j] <= std::numeric_limits<double>::max());
  for (int64_t j = 0; bad && j < H; ++j)
    if (!(px[j] >= 0.0) || std::isinf(px[j]))
      throw py::value_error(std::string(fn) + ": hx[" + std::to_string(j) + "] must be finite and >= 0");
}

HitsArgs check_hits(const char* fn, const TopkInputs& in, const py::object& hptr_, const py::object& hrows_,
                    const py::object& hx_, const py::object& hval_) {
  HitsArgs h;
  check_hit_rows(fn, in, hptr_, hrows_, h);
  check_boosts(fn, hx_, hval_, h);
  return h;
}

py::tuple py_probe(const py::object& X_, const py::object& offsets_, const py::object& Q_, const py::object& qseg_,
                   int64_t k, int64_t probe_k, double temperature, const std::string& convention, int num_threads,
                   double xnorm, const py::object& scan_, const std::string& scan_type, const std::string& path,
                   const py::object& qsel_, const py::object& sel_seg_, const py::object& sel_off_,
                   const py::object& sel_rows_, const py::object& sel_mask_, const py::object& sel_mask_off_,
                   bool keep_scan_scores, const py::object& scan_meta_, const py::object& hit_ptr_,
                   const py::object& hit_rows_, const py::object& hx_, const py::object& hval_, int64_t kf,
                   const py::object& hscale_, const py::object& hden_) {
  const char* fn = "probe";
  check_threads(fn, num_threads);
  TopkInputs in = check_topk(fn, X_, offsets_, Q_, qseg_, k);
  ScanArg sa = check_scan(fn, in, scan_, scan_type, path, num_threads, xnorm, scan_meta_);
  SelArg sel;
  check_select(fn, in, qsel_, sel_seg_, sel_off_, sel_rows_, sel_mask_, sel_mask_off_, sel);
  apply_select(sel, sa.opt);
  if (probe_k < 1) throw py::value_error(std::string(fn) + ": probe_k must be >= 1, got " + std::to_string(probe_k));
  if (!std::isfinite(temperature))
    throw py::value_error(std::string(fn) + ": temperature must be finite, got " + std::to_string(temperature));
  const rfmem::Entropy conv = parse_convention(fn, convention);
  const py::ssize_t b = static_cast<py::ssize_t>(in.b);
  py::array_t<float> scores({b, static_cast<py::ssize_t>(k)});
  py::array_t<int64_t> rows({b, static_cast<py::ssize_t>(k)});
  py::array_t<double> mean(b), ent(b);
  py::array_t<int64_t> count(b);
  float* ps = scores.mutable_data();
  int64_t* pr = rows.mutable_data();
  double* pm = mean.mutable_data();
  double* pe = ent.mutable_data();
  int64_t* pc = count.mutable_data();
  rfmem::TopkOptions opt = sa.opt;
  const bool asked = keep_scan_scores;
  py::array_t<float> kept;
  py::array_t<bool> written;
  if (keep_scan_scores) {  // every row's scan score, for the beam driver's pruning (recollect's ref_scores)
    const int64_t* off = cptr<int64_t>(in.offsets);
    const int64_t* seg = cptr<int64_t>(in.qseg);
    int64_t ld = 1;
    for (int64_t i = 0; i < in.b; ++i) ld = std::max(ld, off[seg[i] + 1] - off[seg[i]]);
    // only where the driver prunes (a segment of kPruneMinRows rows or more), within 16 MiB
    keep_scan_scores = ld >= rfmem::kPruneMinRows && in.b * ld <= (int64_t{1} << 22);
  }
  if (keep_scan_scores) {
    const int64_t* off = cptr<int64_t>(in.offsets);
    const int64_t* seg = cptr<int64_t>(in.qseg);
    int64_t ld = 1;
    for (int64_t i = 0; i < in.b; ++i) ld = std::max(ld, off[seg[i] + 1] - off[seg[i]]);
    kept = py::array_t<float>({b, static_cast<py::ssize_t>(ld)});
    written = py::array_t<bool>(b);
    std::fill(written.mutable_data(), written.mutable_data() + b, false);
    opt.scores_out = kept.mutable_data();
    opt.scores_ld = ld;
    opt.scores_written = reinterpret_cast<uint8_t*>(written.mutable_data());
  }
  const bool hits = !hit_ptr_.is_none() || !hit_rows_.is_none();
  HitsArgs ha;
  py::array_t<float> hit_keys;
  py::array_t<double> hit_up;
  if (hits) {  // the lexical hits' keys (lexical.h fused_topk's hf / hup)
    if (hit_ptr_.is_none() || hit_rows_.is_none())
      throw py::value_error(std::string(fn) + ": hit_ptr and hit_rows go together");
    check_hit_rows(fn, in, hit_ptr_, hit_rows_, ha);
    hit_keys = py::array_t<float>(ha.hrows.shape(0));
    std::fill(hit_keys.mutable_data(), hit_keys.mutable_data() + ha.hrows.shape(0), std::numeric_limits<float>::quiet_NaN());
    hit_up = py::array_t<double>(b);
    opt.hit_ptr = cptr<int64_t>(ha.hptr);
    opt.hit_rows = cptr<int32_t>(ha.hrows);
    opt.hit_keys = hit_keys.mutable_data();
    opt.hit_up = hit_up.mutable_data();
  }
  // the fused top-kf of each query, taken on the scan's threads right after its dense list (lexical.h FusedTopk)
  if (kf < 0) throw py::value_error(std::string(fn) + ": kf must be >= 0, got " + std::to_string(kf));
  if (kf > 0 && !hits) throw py::value_error(std::string(fn) + ": kf > 0 needs hit_ptr and hit_rows");
  if (kf > 0 && !qsel_.is_none())
    throw py::value_error(std::string(fn) + ": kf > 0 takes no row selection (qsel must be None)");
  if (kf > k) throw py::value_error(std::string(fn) + ": kf must be <= k (the dense list it starts from), got kf = " +
                                    std::to_string(kf) + ", k = " + std::to_string(k));
  const py::ssize_t fs = static_cast<py::ssize_t>(kf);
  py::array_t<int64_t> f_rows;
  py::array_t<double> f_fused, f_lex;
  py::array_t<float> f_dense;
  std::unique_ptr<rfmem::FusedTopk> fz;
  py::array hscale, hden;
  if (kf > 0 && !hscale_.is_none()) {  // the boosts as per-query factors (computed on the threads)
    if (!hx_.is_none()) throw py::value_error(std::string(fn) + ": give hx or hscale, not both");
    hscale = checked<double>(hscale_, fn, "hscale", 1, "float64");
    if (hscale.shape(0) != b) throw py::value_error(std::string(fn) + ": hscale must have one entry per query");
    if (!hden_.is_none()) {
      hden = checked<double>(hden_, fn, "hden", 1, "float64");
      if (hden.shape(0) != b) throw py::value_error(std::string(fn) + ": hden must have one entry per query");
    }
  } else if (!hscale_.is_none() || !hden_.is_none()) {
    throw py::value_error(std::string(fn) +
                          (hscale_.is_none() ? ": hden goes with hscale" : ": hscale goes with kf > 0"));
  }
  if (kf > 0) {
    check_boosts(fn, hx_, hval_, ha);
    f_rows = py::array_t<int64_t>({b, fs});
    f_fused = py::array_t<double>({b, fs});
    f_lex = py::array_t<double>({b, fs});
    f_dense = py::array_t<float>({b, fs});
    if (!(opt.xnorm >= 0.0)) {  // one bound for the scan and the fused re-scoring
      py::gil_scoped_release nogil;
      opt.xnorm = rfmem::row_norm_bound(cptr<float>(in.X), in.n, in.d);
    }
    fz.reset(new rfmem::FusedTopk(rfmem::FusedArgs{
        cptr<float>(in.X), in.d, cptr<int64_t>(in.offsets), cptr<float>(in.Q), cptr<int64_t>(in.qseg), in.b, ps, pr, k,
        cptr<int64_t>(ha.hptr), cptr<int32_t>(ha.hrows), hscale_.is_none() ? cptr<double>(ha.hx) : nullptr,
        cptr<double>(ha.hval), kf, opt.xnorm,
        f_rows.mutable_data(), f_fused.mutable_data(), f_dense.mutable_data(), f_lex.mutable_data(),
        opt.hit_keys, opt.hit_up, hscale_.is_none() ? nullptr : cptr<double>(hscale),
        hden_.is_none() ? nullptr : cptr<double>(hden)}));
    opt.after = fz.get();
  } else if (!hx_.is_none() || !hval_.is_none()) {
    throw py::value_error(std::string(fn) + ": hx and hval go with kf > 0");
  }
  {
    py::gil_scoped_release nogil;
    rfmem::segmented_topk(cptr<float>(in.X), in.n, in.d, cptr<int64_t>(in.offsets), in.U, cptr<float>(in.Q),
                          cptr<int64_t>(in.qseg), in.b, k, ps, pr, opt);
    rfmem::probe_signals(ps, in.b, k, probe_k, temperature, conv, pm, pe, pc, num_threads);
  }
  if (fz && fz->bad_boost() >= 0)
    throw py::value_error(std::string(fn) + ": the boosts of query " + std::to_string(fz->bad_boost()) +
                          " from hscale / hden and hval must be finite and >= 0");
  py::list out;
  for (const py::object& o : {py::object(scores), py::object(rows), py::object(mean), py::object(ent), py::object(count)})
    out.append(o);
  if (asked) {  // (None, None) where the scores were not kept
    out.append(keep_scan_scores ? py::object(kept) : py::none());
    out.append(keep_scan_scores ? py::object(written) : py::none());
  }
  if (hits) {
    out.append(hit_keys);
    out.append(hit_up);
  }
  if (kf > 0)
    for (const py::object& o : {py::object(f_rows), py::object(f_fused), py::object(f_dense), py::object(f_lex)})
      out.append(o);
  return py::tuple(out);
}

py::tuple py_bm25_hits(const py::list& users_, const py::object& quser_, const py::object& qterms_,
                       const py::object& qcnt_, const py::object& qptr_, int num_threads) {
  const char* fn = "bm25_hits";
  check_threads(fn, num_threads);
  std::vector<rfmem::PostingsRef> users;
  std::vector<py::array> keep;  // the arrays stay alive while the GIL is released
  users.reserve(users_.size());
  for (size_t u = 0; u < users_.size(); ++u) {
    const std::string nm = "users[" + std::to_string(u) + "]";
    py::tuple t = py::cast<py::tuple>(users_[u]);
    if (t.size() != 5)
      throw py::value_error(std::string(fn) + ": " + nm + " must be (terms, ptr, rows, weight, n_rows)");
    py::array terms = checked<int32_t>(t[0], fn, (nm + ".terms").c_str(), 1, "int32");
    py::array ptr = checked<int64_t>(t[1], fn, (nm + ".ptr").c_str(), 1, "int64");
    py::array rows = checked<int32_t>(t[2], fn, (nm + ".rows").c_str(), 1, "int32");
    py::array weight = checked<double>(t[3], fn, (nm + ".weight").c_str(), 1, "float64");
    const int64_t n_rows = py::cast<int64_t>(t[4]);
    const int64_t T = terms.shape(0), P = rows.shape(0);
    if (ptr.shape(0) != T + 1 || weight.shape(0) != P)
      throw py::value_error(std::string(fn) + ": " + nm + " has inconsistent shapes (ptr must have T + 1 entries, "
                            "weight one per row entry)");
    const int64_t* pp = cptr<int64_t>(ptr);
    if (pp[0] != 0 || pp[T] != P)
      throw py::value_error(std::string(fn) + ": " + nm + ".ptr must run from 0 to len(rows)");
    if (n_rows < 0) throw py::value_error(std::string(fn) + ": " + nm + ".n_rows must be >= 0");
    // the postings a query reads are checked as they are read (O(query), not O(index))
    const int32_t* pr = cptr<int32_t>(rows);
    users.push_back(rfmem::PostingsRef{cptr<int32_t>(terms), T, pp, pr, cptr<double>(weight), n_rows});
    keep.insert(keep.end(), {terms, ptr, rows, weight});
  }
  py::array quser = checked<int64_t>(quser_, fn, "quser", 1, "int64");
  py::array qterms = checked<int32_t>(qterms_, fn, "qterms", 1, "int32");
  py::array qcnt = checked<double>(qcnt_, fn, "qcnt", 1, "float64");
  py::array qptr = checked<int64_t>(qptr_, fn, "qptr", 1, "int64");
  const int64_t b = quser.shape(0);
  if (qptr.shape(0) != b + 1)
    throw py::value_error(std::string(fn) + ": qptr must have len(quser) + 1 entries, got shape " + shape_str(qptr));
  if (qcnt.shape(0) != qterms.shape(0))
    throw py::value_error(std::string(fn) + ": qcnt must have one entry per qterms entry");
  const int64_t* qp = cptr<int64_t>(qptr);
  const int64_t* qu = cptr<int64_t>(quser);
  if (qp[0] != 0 || qp[b] != qterms.shape(0))
    throw py::value_error(std::string(fn) + ": qptr must run from 0 to len(qterms)");
  for (int64_t i = 0; i < b; ++i) {
    if (qp[i + 1] < qp[i]) throw py::value_error(std::string(fn) + ": qptr must be non-decreasing");
    if (qu[i] >= static_cast<int64_t>(users.size()))
      throw py::value_error(std::string(fn) + ": quser[" + std::to_string(i) + "] = " + std::to_string(qu[i]) +
                            " is not an index into users (or < 0 for none)");
  }
  std::vector<int64_t> hptr, order;
  std::vector<rfmem::HitsPart> parts;
  const py::ssize_t bs = static_cast<py::ssize_t>(b);
  py::array_t<double> mx(bs), top({bs, static_cast<py::ssize_t>(rfmem::kTopLexical)}), sum(bs), sumsq(bs);
  double* pm = mx.mutable_data();
  double* pt = top.mutable_data();
  double* ps = sum.mutable_data();
  double* ps2 = sumsq.mutable_data();
  int64_t bad = -1;
  {
    py::gil_scoped_release nogil;
    bad = rfmem::bm25_hits(users.data(), static_cast<int64_t>(users.size()), qu, b, cptr<int32_t>(qterms),
                           cptr<double>(qcnt), qp, num_threads, hptr, order, parts, pm, pt, ps, ps2);
  }
  if (bad >= 0)
    throw py::value_error(std::string(fn) + ": the postings of users[" + std::to_string(bad) +
                          "] are malformed (ptr not non-decreasing, or rows outside [0, n_rows))");
  py::array_t<int64_t> o_ptr(static_cast<py::ssize_t>(hptr.size()));
  py::array_t<int32_t> o_rows(static_cast<py::ssize_t>(hptr.back()));
  py::array_t<double> o_val(static_cast<py::ssize_t>(hptr.back()));
  std::copy(hptr.begin(), hptr.end(), o_ptr.mutable_data());
  {
    int32_t* orow = o_rows.mutable_data();
    double* oval = o_val.mutable_data();
    py::gil_scoped_release nogil;
    rfmem::bm25_gather(parts, order, hptr, num_threads, orow, oval);
  }
  return py::make_tuple(o_ptr, o_rows, o_val, mx, top, sum, sumsq);
}

py::tuple py_fused_topk(const py::object& X_, const py::object& offsets_, const py::object& Q_,
                        const py::object& qseg_, const py::object& dsc_, const py::object& drows_,
                        const py::object& hptr_, const py::object& hrows_, const py::object& hx_,
                        const py::object& hval_, int64_t kf, int num_threads, double xnorm, const py::object& hf_,
                        const py::object& hup_) {
  const char* fn = "fused_topk";
  check_threads(fn, num_threads);
  TopkInputs in = check_topk(fn, X_, offsets_, Q_, qseg_, kf);
  py::array dsc = checked<float>(dsc_, fn, "dense_scores", 2, "float32");
  py::array drows = checked<int64_t>(drows_, fn, "dense_rows", 2, "int64");
  const HitsArgs ha = check_hits(fn, in, hptr_, hrows_, hx_, hval_);
  const int64_t b = in.b;
  if (dsc.shape(0) != b || drows.shape(0) != b || drows.shape(1) != dsc.shape(1))
    throw py::value_error(std::string(fn) + ": dense_scores and dense_rows must both be [b, K] with b = " +
                          std::to_string(b) + ", got " + shape_str(dsc) + " and " + shape_str(drows));
  const int64_t K = dsc.shape(1);
  const int64_t* hp = cptr<int64_t>(ha.hptr);
  const int64_t* off = cptr<int64_t>(in.offsets);
  const int64_t* seg = cptr<int64_t>(in.qseg);
  const int64_t* dr = cptr<int64_t>(drows);
  const int32_t* hr = cptr<int32_t>(ha.hrows);
  const double* px = cptr<double>(ha.hx);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t a = off[seg[i]], len = off[seg[i] + 1] - a;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = dr[i * K + j];
      if (r != -1 && (r < a || r >= a + len))
        throw py::value_error(std::string(fn) + ": dense_rows[" + std::to_string(i) + ", " + std::to_string(j) +
                              "] is not -1 or a row of the query's segment");
    }
  }
  py::array hf, hup;
  if (!hf_.is_none()) {
    hf = checked<float>(hf_, fn, "hf", 1, "float32");
    if (hf.shape(0) != ha.hrows.shape(0))
      throw py::value_error(std::string(fn) + ": hf must have one entry per hrows entry");
  }
  if (!hup_.is_none()) {
    if (hf_.is_none()) throw py::value_error(std::string(fn) + ": hup needs hf (the keys it bounds)");
    hup = checked<double>(hup_, fn, "hup", 1, "float64");
    if (hup.shape(0) != b) throw py::value_error(std::string(fn) + ": hup must have one entry per query");
    const double* pu = cptr<double>(hup);
    for (int64_t i = 0; i < b; ++i)
      if (!(pu[i] >= 0.0))
        throw py::value_error(std::string(fn) + ": hup[" + std::to_string(i) + "] must be >= 0 (+inf: not recorded)");
  }
  const py::ssize_t bs = static_cast<py::ssize_t>(b), ks = static_cast<py::ssize_t>(kf);
  py::array_t<int64_t> rows({bs, ks});
  py::array_t<double> fused({bs, ks}), lex({bs, ks});
  py::array_t<float> dense({bs, ks});
  int64_t* o_r = rows.mutable_data();
  double* o_f = fused.mutable_data();
  float* o_d = dense.mutable_data();
  double* o_l = lex.mutable_data();
  {
    py::gil_scoped_release nogil;
    double xn = xnorm;
    if (!(xn >= 0.0)) xn = rfmem::row_norm_bound(cptr<float>(in.X), in.n, in.d);
    rfmem::fused_topk(cptr<float>(in.X), in.d, off, cptr<float>(in.Q), seg, b, cptr<float>(dsc), dr, K, hp, hr, px,
                      cptr<double>(ha.hval), kf, xn, num_threads, o_r, o_f, o_d, o_l,
                      hf_.is_none() ? nullptr : cptr<float>(hf), hup_.is_none() ? nullptr : cptr<double>(hup));
  }
  return py::make_tuple(rows, fused, dense, lex);
}

py::tuple py_context_topk(const py::object& X_, const py::object& offsets_, const py::object& Q_,
                          const py::object& qseg_, const py::object& f_, const py::object& fptr_,
                          const py::object& boosts_, const py::object& quser_, const py::object& lay_,
                          const py::object& lay_ptr_, const py::object& tstart_, const py::object& t_ptr_,
                          const py::object& fstart_, int64_t r, double w_n, double w_s, int64_t k, double scale,
                          double abs_term, double xnorm, int num_threads) {
  const char* fn = "context_topk";
  check_threads(fn, num_threads);
  TopkInputs in = check_topk(fn, X_, offsets_, Q_, qseg_, k);
  py::array f = checked<float>(f_, fn, "f", 1, "float32");
  py::array fptr = checked<int64_t>(fptr_, fn, "fptr", 1, "int64");
  py::array quser = checked<int64_t>(quser_, fn, "quser", 1, "int64");
  py::array lay = checked<int32_t>(lay_, fn, "lay", 1, "int32");
  py::array lay_ptr = checked<int64_t>(lay_ptr_, fn, "lay_ptr", 1, "int64");
  py::array tstart = checked<int32_t>(tstart_, fn, "tstart", 1, "int32");
  py::array t_ptr = checked<int64_t>(t_ptr_, fn, "t_ptr", 1, "int64");
  py::array fstart = checked<int64_t>(fstart_, fn, "fstart", 1, "int64");
  if (r < 1) throw py::value_error(std::string(fn) + ": r must be >= 1, got " + std::to_string(r));
  if (!(w_n >= 0.0) || !(w_s >= 0.0) || std::isinf(w_n) || std::isinf(w_s))
    throw py::value_error(std::string(fn) + ": w_n and w_s must be finite and >= 0");
  const int64_t b = in.b;
  const int64_t m = fstart.shape(0);
  if (fptr.shape(0) != b + 1 || quser.shape(0) != b)
    throw py::value_error(std::string(fn) + ": fptr must have b + 1 entries and quser b");
  if (lay_ptr.shape(0) != m + 1 || t_ptr.shape(0) != m + 1)
    throw py::value_error(std::string(fn) + ": lay_ptr and t_ptr must have one entry per layout + 1");
  const int64_t* off = cptr<int64_t>(in.offsets);
  const int64_t* seg = cptr<int64_t>(in.qseg);
  const int64_t* fp = cptr<int64_t>(fptr);
  const int64_t* qu = cptr<int64_t>(quser);
  const int64_t* lp = cptr<int64_t>(lay_ptr);
  const int64_t* tp = cptr<int64_t>(t_ptr);
  const int64_t* fsv = cptr<int64_t>(fstart);
  const int32_t* ly = cptr<int32_t>(lay);
  const int32_t* ts = cptr<int32_t>(tstart);
  if (fp[0] != 0 || fp[b] != f.shape(0)) throw py::value_error(std::string(fn) + ": fptr must run from 0 to len(f)");
  if (lp[0] != 0 || lp[m] != lay.shape(0) || tp[0] != 0 || tp[m] != tstart.shape(0))
    throw py::value_error(std::string(fn) + ": lay_ptr / t_ptr must run from 0 to len(lay) / len(tstart)");
  const double* px = nullptr;
  py::array boosts;
  if (!boosts_.is_none()) {
    boosts = checked<double>(boosts_, fn, "boosts", 1, "float64");
    if (boosts.shape(0) != f.shape(0)) throw py::value_error(std::string(fn) + ": boosts must have one entry per f entry");
    px = cptr<double>(boosts);
  }
  std::vector<char> checked_layout(static_cast<size_t>(m), 0);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = off[seg[i] + 1] - off[seg[i]];
    if (fp[i + 1] - fp[i] != n)
      throw py::value_error(std::string(fn) + ": query " + std::to_string(i) + " must have one scan score per row of its segment");
    const int64_t j = qu[i];
    if (j < -1 || j >= m) throw py::value_error(std::string(fn) + ": quser[" + std::to_string(i) + "] is not a layout index");
    if (j < 0) continue;  // a query left to the caller (padding here)
    if (checked_layout[j]) continue;
    checked_layout[j] = 1;
    const int64_t L = lp[j + 1] - lp[j], nt = tp[j + 1] - tp[j];
    if (L < 2 * r || fsv[j] < r || fsv[j] > L - r)
      throw py::value_error(std::string(fn) + ": layout " + std::to_string(j) + " is malformed for r = " + std::to_string(r));
    for (int64_t p = 0; p < L; ++p) {
      const int32_t row = ly[lp[j] + p];
      if (row < -1 || row >= n || ((p < r || p >= L - r) && row != -1))
        throw py::value_error(std::string(fn) + ": layout " + std::to_string(j) + " holds an invalid row at position " + std::to_string(p));
    }
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t s0 = ts[tp[j] + t], e = t + 1 < nt ? ts[tp[j] + t + 1] : fsv[j];
      if (s0 < r || e <= s0 || e > fsv[j])
        throw py::value_error(std::string(fn) + ": layout " + std::to_string(j) + " has malformed thread blocks");
      for (int64_t p = e - r; p < e; ++p)
        if (ly[lp[j] + p] != -1)
          throw py::value_error(std::string(fn) + ": layout " + std::to_string(j) + " lacks the sentinels after a block");
    }
  }
  py::array_t<int64_t> rows({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(k)});
  py::array_t<double> c({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(k)});
  py::array_t<double> base({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(k)});
  py::array_t<float> dense({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(k)});
  const rfmem::ContextLayouts lo{ly, lp, ts, tp, fsv};
  {
    py::gil_scoped_release nogil;
    rfmem::context_topk(cptr<float>(in.X), in.d, off, cptr<float>(in.Q), seg, b, cptr<float>(f), fp, px, qu, lo, r,
                        w_n, w_s, k, scale, abs_term, xnorm, num_threads, rows.mutable_data(), c.mutable_data(),
                        base.mutable_data(), dense.mutable_data());
  }
  return py::make_tuple(rows, c, base, dense);
}

py::tuple py_hybrid_probe(const py::object& X_, const py::object& offsets_, const py::object& Q_,
                          const py::object& qseg_, int64_t k, int64_t probe_k, double temperature,
                          const std::string& convention, const py::object& hptr_, const py::object& hrows_,
                          const py::object& hx_, const py::object& hval_, int64_t kf, int num_threads, double xnorm) {
  const char* fn = "hybrid_probe";
  check_threads(fn, num_threads);
  TopkInputs in = check_topk(fn, X_, offsets_, Q_, qseg_, k);
  if (kf < 0) throw py::value_error(std::string(fn) + ": kf must be >= 0, got " + std::to_string(kf));
  if (probe_k < 1) throw py::value_error(std::string(fn) + ": probe_k must be >= 1, got " + std::to_string(probe_k));
  if (!std::isfinite(temperature))
    throw py::value_error(std::string(fn) + ": temperature must be finite, got " + std::to_string(temperature));
  const rfmem::Entropy conv = parse_convention(fn, convention);
  const HitsArgs ha = check_hits(fn, in, hptr_, hrows_, hx_, hval_);
  const py::ssize_t b = static_cast<py::ssize_t>(in.b), ks = static_cast<py::ssize_t>(kf);
  py::array_t<float> scores({b, static_cast<py::ssize_t>(k)});
  py::array_t<int64_t> rows({b, static_cast<py::ssize_t>(k)});
  py::array_t<double> mean(b), ent(b);
  py::array_t<int64_t> count(b);
  py::array_t<int64_t> frows({b, ks});
  py::array_t<double> ffused({b, ks}), flex({b, ks});
  py::array_t<float> fdense({b, ks});
  py::array_t<float> hf(ha.hrows.shape(0));
  float* ph = hf.mutable_data();
  float* ps = scores.mutable_data();
  int64_t* pr = rows.mutable_data();
  double* pm = mean.mutable_data();
  double* pe = ent.mutable_data();
  int64_t* pc = count.mutable_data();
  int64_t* o_r = frows.mutable_data();
  double* o_f = ffused.mutable_data();
  float* o_d = fdense.mutable_data();
  double* o_l = flex.mutable_data();
  {
    py::gil_scoped_release nogil;
    rfmem::hybrid_probe(cptr<float>(in.X), in.n, in.d, cptr<int64_t>(in.offsets), cptr<float>(in.Q),
                        cptr<int64_t>(in.qseg), in.b, k, cptr<int64_t>(ha.hptr), cptr<int32_t>(ha.hrows),
                        cptr<double>(ha.hx), cptr<double>(ha.hval), kf, xnorm, num_threads, ps, pr, o_r, o_f, o_d,
                        o_l, ph);
    rfmem::probe_signals(ps, in.b, k, probe_k, temperature, conv, pm, pe, pc, num_threads);
  }
  return py::make_tuple(scores, rows, mean, ent, count, frows, ffused, fdense, flex, hf);
}

py::tuple py_batched_kmeans(const py::object& V_, const py::object& counts_, const py::object& clusters_,
                            int64_t iters, double tol, const py::object& draws_, int num_threads) {
  const char* fn = "batched_kmeans";
  check_threads(fn, num_threads);
  py::array V = checked<float>(V_, fn, "V", 3, "float32");
  py::array counts = checked<int64_t>(counts_, fn, "counts", 1, "int64");
  py::array clusters = checked<int64_t>(clusters_, fn, "clusters", 1, "int64");
  py::array draws = checked<double>(draws_, fn, "draws", 2, "float64");
  const int64_t m = V.shape(0), n = V.shape(1), d = V.shape(2);
  const int64_t n_draws = draws.shape(1);
  for (const auto& pr : {std::make_pair("counts", &counts), std::make_pair("clusters", &clusters),
                         std::make_pair("draws", &draws)}) {
    if (pr.second->shape(0) != m)
      throw py::value_error(std::string(fn) + ": " + pr.first + " must have one entry per problem (" +
                            std::to_string(m) + "), got shape " + shape_str(*pr.second));
  }
  if (d < 1) throw py::value_error(std::string(fn) + ": V must have d >= 1, got shape " + shape_str(V));
  if (iters < 0) throw py::value_error(std::string(fn) + ": iters must be >= 0, got " + std::to_string(iters));
  if (!std::isfinite(tol) || tol < 0)
    throw py::value_error(std::string(fn) + ": tol must be finite and >= 0, got " + std::to_string(tol));
  const int64_t* cnt = cptr<int64_t>(counts);
  const int64_t* kc = cptr<int64_t>(clusters);
  int64_t c_max = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (cnt[i] < 1 || cnt[i] > n)
      throw py::value_error(std::string(fn) + ": counts[" + std::to_string(i) + "] = " + std::to_string(cnt[i]) +
                            " must be in [1, " + std::to_string(n) + "]");
    if (kc[i] < 1 || kc[i] > cnt[i])
      throw py::value_error(std::string(fn) + ": clusters[" + std::to_string(i) + "] = " + std::to_string(kc[i]) +
                            " must be in [1, counts[" + std::to_string(i) + "] = " + std::to_string(cnt[i]) + "]");
    if (rfmem::kmeanspp_draws(kc[i]) > n_draws)
      throw py::value_error(std::string(fn) + ": draws has " + std::to_string(n_draws) + " columns but problem " +
                            std::to_string(i) + " (" + std::to_string(kc[i]) + " clusters) needs " +
                            std::to_string(rfmem::kmeanspp_draws(kc[i])) + " (1 + (k - 1) * (2 + int(ln k)))");
    c_max = std::max(c_max, kc[i]);
  }
  py::array_t<int64_t> labels({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(n)});
  py::array_t<float> cents({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(c_max), static_cast<py::ssize_t>(d)});
  int64_t* pl = labels.mutable_data();
  float* pc = cents.mutable_data();
  {
    py::gil_scoped_release nogil;
    rfmem::batched_kmeans(cptr<float>(V), m, n, d, cnt, kc, c_max, iters, tol, cptr<double>(draws), n_draws, pl,
                          pc, num_threads);
  }
  return py::make_tuple(labels, cents);
}

py::array_t<float> py_alpha_mix(const py::object& qb_, const py::object& centroids_, const py::object& q0_,
                                double alpha, int num_threads) {
  const char* fn = "alpha_mix";
  check_threads(fn, num_threads);
  py::array qb = checked<float>(qb_, fn, "qb", 2, "float32");
  py::array cen = checked<float>(centroids_, fn, "centroids", 3, "float32");
  py::array q0 = checked<float>(q0_, fn, "q0", 2, "float32");
  const int64_t m = cen.shape(0), c = cen.shape(1), d = cen.shape(2);
  if (qb.shape(0) != m || qb.shape(1) != d)
    throw py::value_error(std::string(fn) + ": qb must be [m, d] = [" + std::to_string(m) + ", " + std::to_string(d) +
                          "] like centroids, got shape " + shape_str(qb));
  if (q0.shape(0) != m || q0.shape(1) != d)
    throw py::value_error(std::string(fn) + ": q0 must be [m, d] = [" + std::to_string(m) + ", " + std::to_string(d) +
                          "] like centroids, got shape " + shape_str(q0));
  if (!std::isfinite(alpha)) throw py::value_error(std::string(fn) + ": alpha must be finite");
  py::array_t<float> out({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(c), static_cast<py::ssize_t>(d)});
  float* po = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    rfmem::alpha_mix(cptr<float>(qb), cptr<float>(cen), cptr<float>(q0), m, c, d, alpha, po, num_threads);
  }
  return out;
}

py::tuple py_unit_rows(const py::object& X_, double eps, int num_threads) {
  const char* fn = "unit_rows";
  check_threads(fn, num_threads);
  py::array X = checked<float>(X_, fn, "X", 2, "float32");
  if (!(eps >= 0.0)) throw py::value_error(std::string(fn) + ": eps must be >= 0, got " + std::to_string(eps));
  const int64_t n = X.shape(0), d = X.shape(1);
  py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(d)});
  float* po = out.mutable_data();
  int64_t bad;
  {
    py::gil_scoped_release nogil;
    bad = rfmem::unit_rows(cptr<float>(X), n, d, eps, po, num_threads);
  }
  return py::make_tuple(out, bad);
}

py::array_t<double> py_max_similarity(const py::object& V_, const py::object& counts_, int num_threads) {
  const char* fn = "max_similarity";
  check_threads(fn, num_threads);
  py::array V = checked<float>(V_, fn, "V", 3, "float32");
  py::array counts = checked<int64_t>(counts_, fn, "counts", 1, "int64");
  const int64_t m = V.shape(0), n = V.shape(1), d = V.shape(2);
  if (counts.shape(0) != m)
    throw py::value_error(std::string(fn) + ": counts must have one entry per set (" + std::to_string(m) +
                          "), got shape " + shape_str(counts));
  const int64_t* cnt = cptr<int64_t>(counts);
  for (int64_t i = 0; i < m; ++i) {
    if (cnt[i] < 0 || cnt[i] > n)
      throw py::value_error(std::string(fn) + ": counts[" + std::to_string(i) + "] = " + std::to_string(cnt[i]) +
                            " must be in [0, " + std::to_string(n) + "]");
  }
  py::array_t<double> out({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(n)});
  double* po = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    rfmem::max_similarity(cptr<float>(V), m, n, d, cnt, po, num_threads);
  }
  return out;
}

py::tuple py_recollect(const py::object& X_, const py::object& offsets_, const py::object& Q0_,
                       const py::object& qseg_, const py::object& level0_scores_, const py::object& level0_rows_,
                       int64_t beam_width, int64_t fanout, int64_t max_rounds, int64_t out_k, double alpha,
                       double mmr_lambda, double score_floor, int64_t kmeans_iters, double kmeans_tol,
                       const py::object& draws_, int64_t width, int num_threads, double xnorm,
                       int64_t memory_budget, const py::object& active_, const py::object& scan_,
                       const std::string& scan_type, const std::string& path, const py::object& qsel_,
                       const py::object& sel_seg_, const py::object& sel_off_, const py::object& sel_rows_,
                       const py::object& sel_mask_, const py::object& sel_mask_off_, const py::object& stats_,
                       const py::object& ref_scores_, const py::object& ref_ok_, bool dense,
                       const py::object& scan_meta_) {
  const char* fn = "recollect";
  check_threads(fn, num_threads);
  auto check_range = [fn](const char* name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
      throw py::value_error(std::string(fn) + ": " + name + " must be in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "], got " + std::to_string(v));
  };
  check_range("beam_width", beam_width, 1, 64);
  check_range("fanout", fanout, 1, 64);
  check_range("max_rounds", max_rounds, 1, 64);
  check_range("out_k", out_k, 1, int64_t{1} << 20);
  check_range("kmeans_iters", kmeans_iters, 0, 1000);
  if (!std::isfinite(alpha)) throw py::value_error(std::string(fn) + ": alpha must be finite");
  if (!(mmr_lambda >= 0.0 && mmr_lambda <= 1.0))
    throw py::value_error(std::string(fn) + ": mmr_lambda must be in [0, 1], got " + std::to_string(mmr_lambda));
  if (!std::isfinite(score_floor)) throw py::value_error(std::string(fn) + ": score_floor must be finite");
  if (!std::isfinite(kmeans_tol) || kmeans_tol < 0)
    throw py::value_error(std::string(fn) + ": kmeans_tol must be finite and >= 0, got " +
                          std::to_string(kmeans_tol));
  if (memory_budget < 1)
    throw py::value_error(std::string(fn) + ": memory_budget must be >= 1 byte, got " + std::to_string(memory_budget));
  TopkInputs in = check_topk(fn, X_, offsets_, Q0_, qseg_, 1);
  ScanArg sa = check_scan(fn, in, scan_, scan_type, path, num_threads, xnorm, scan_meta_);
  SelArg sel;
  check_select(fn, in, qsel_, sel_seg_, sel_off_, sel_rows_, sel_mask_, sel_mask_off_, sel);
  apply_select(sel, sa.opt);
  rfmem::RecollectConfig cfg;
  cfg.beam_width = beam_width;
  cfg.fanout = fanout;
  cfg.max_rounds = max_rounds;
  cfg.out_k = out_k;
  cfg.alpha = alpha;
  cfg.mmr_lambda = mmr_lambda;
  cfg.score_floor = static_cast<float>(score_floor);  // the Python driver compares float32 scores in float32
  cfg.kmeans_iters = kmeans_iters;
  cfg.kmeans_tol = kmeans_tol;
  py::array draws = checked<double>(draws_, fn, "draws", 2, "float64");
  if (draws.shape(0) != beam_width + 1 || draws.shape(1) < rfmem::kmeanspp_draws(beam_width))
    throw py::value_error(std::string(fn) + ": draws must be [beam_width + 1, >= " +
                          std::to_string(rfmem::kmeanspp_draws(beam_width)) +
                          "] (row k: scikit-learn's draws for k clusters), got shape " + shape_str(draws));
  cfg.draws = cptr<double>(draws);
  cfg.n_draws = draws.shape(1);
  check_range("width", width, 1, int64_t{1} << 30);
  const float* l0s = nullptr;
  const int64_t* l0r = nullptr;
  int64_t k0 = 0;
  py::array l0_scores, l0_rows;
  if (level0_scores_.is_none() != level0_rows_.is_none())
    throw py::value_error(std::string(fn) + ": level0_scores and level0_rows must be given together");
  if (!level0_scores_.is_none()) {
    l0_scores = checked<float>(level0_scores_, fn, "level0_scores", 2, "float32");
    l0_rows = checked<int64_t>(level0_rows_, fn, "level0_rows", 2, "int64");
    k0 = l0_scores.shape(1);
    if (l0_scores.shape(0) != in.b || l0_rows.shape(0) != in.b || l0_rows.shape(1) != k0)
      throw py::value_error(std::string(fn) + ": level0_scores and level0_rows must both be [b, k0] with b = " +
                            std::to_string(in.b) + ", got shapes " + shape_str(l0_scores) + " and " +
                            shape_str(l0_rows));
    if (k0 < beam_width * fanout)
      throw py::value_error(std::string(fn) + ": level0 must hold at least beam_width * fanout = " +
                            std::to_string(beam_width * fanout) + " columns, got " + std::to_string(k0));
    l0s = cptr<float>(l0_scores);
    l0r = cptr<int64_t>(l0_rows);
    const int64_t* off = cptr<int64_t>(in.offsets);
    const int64_t* seg = cptr<int64_t>(in.qseg);
    for (int64_t i = 0; i < in.b; ++i) {
      for (int64_t j = 0; j < k0; ++j) {
        const int64_t r = l0r[i * k0 + j];
        if (r != -1 && (r < off[seg[i]] || r >= off[seg[i] + 1]))
          throw py::value_error(std::string(fn) + ": level0_rows[" + std::to_string(i) + ", " + std::to_string(j) +
                                "] = " + std::to_string(r) + " is neither -1 nor a row of the query's segment [" +
                                std::to_string(off[seg[i]]) + ", " + std::to_string(off[seg[i] + 1]) + ")");
      }
    }
  }
  const uint8_t* act = nullptr;
  py::array active;
  if (!active_.is_none()) {
    active = checked<bool>(active_, fn, "active", 1, "bool");
    if (active.shape(0) != in.b)
      throw py::value_error(std::string(fn) + ": active must have one entry per query (" + std::to_string(in.b) +
                            "), got shape " + shape_str(active));
    act = static_cast<const uint8_t*>(active.data());
  }
  const py::ssize_t b = static_cast<py::ssize_t>(in.b);
  py::array_t<int64_t> rows({b, static_cast<py::ssize_t>(width)});
  py::array_t<float> scores({b, static_cast<py::ssize_t>(width)});
  py::array_t<int64_t> rounds(b);
  int64_t* pr = rows.mutable_data();
  float* ps = scores.mutable_data();
  int64_t* pn = rounds.mutable_data();
  double* pst = nullptr;
  py::array stats;
  if (!stats_.is_none()) {
    stats = checked<double>(stats_, fn, "stats", 1, "float64");
    if (stats.shape(0) != rfmem::kRecollectStats)
      throw py::value_error(std::string(fn) + ": stats must be float64 [" + std::to_string(rfmem::kRecollectStats) +
                            "], got shape " + shape_str(stats));
    if (!stats.writeable()) throw py::value_error(std::string(fn) + ": stats must be writeable");
    pst = static_cast<double*>(stats.mutable_data());
  }
  const float* ref = nullptr;
  const uint8_t* ref_ok = nullptr;
  int64_t ref_ld = 0;
  py::array ref_scores, ref_okay;
  if (ref_scores_.is_none() != ref_ok_.is_none())
    throw py::value_error(std::string(fn) + ": ref_scores and ref_ok must be given together");
  if (!ref_scores_.is_none()) {
    ref_scores = checked<float>(ref_scores_, fn, "ref_scores", 2, "float32");
    ref_okay = checked<bool>(ref_ok_, fn, "ref_ok", 1, "bool");
    const int64_t* off = cptr<int64_t>(in.offsets);
    const int64_t* seg = cptr<int64_t>(in.qseg);
    int64_t longest = 0;
    for (int64_t i = 0; i < in.b; ++i) longest = std::max(longest, off[seg[i] + 1] - off[seg[i]]);
    if (ref_scores.shape(0) != in.b || ref_scores.shape(1) < longest || ref_okay.shape(0) != in.b)
      throw py::value_error(std::string(fn) + ": ref_scores must be [b, >= " + std::to_string(longest) +
                            "] and ref_ok [b] with b = " + std::to_string(in.b) + ", got shapes " +
                            shape_str(ref_scores) + " and " + shape_str(ref_okay));
    ref = cptr<float>(ref_scores);
    ref_ok = static_cast<const uint8_t*>(ref_okay.data());
    ref_ld = ref_scores.shape(1);
  }
  py::array_t<float> dense_out;
  float* pd = nullptr;
  if (dense) {
    dense_out = py::array_t<float>({b, static_cast<py::ssize_t>(out_k)});
    pd = dense_out.mutable_data();
  }
  {
    py::gil_scoped_release nogil;
    rfmem::recollect(cptr<float>(in.X), in.n, in.d, cptr<int64_t>(in.offsets), in.U, cptr<float>(in.Q),
                     cptr<int64_t>(in.qseg), in.b, l0s, l0r, k0, cfg, width, pr, ps, pn, num_threads, xnorm,
                     memory_budget, act, &sa.opt, pst, ref, ref_ld, ref_ok, pd);
  }
  if (dense) return py::make_tuple(rows, scores, rounds, dense_out);
  return py::make_tuple(rows, scores, rounds);
}

}  // namespace

// TokenIds.sync: the tokens of ``tokens`` (a list of str, the Vocabulary's) past the
// table's size appended in order (ids = list positions).
void token_ids_sync(rfmem::TokenIds& t, const py::list& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t i = t.size(); i < n; ++i) {
    const py::handle o = tokens[static_cast<size_t>(i)];
    if (!py::isinstance<py::str>(o))
      throw py::type_error("TokenIds.sync: tokens[" + std::to_string(i) + "] must be a str, got " +
                           std::string(py::str(py::type::handle_of(o).attr("__name__"))));
    Py_ssize_t len = 0;
    const char* p = PyUnicode_AsUTF8AndSize(o.ptr(), &len);
    if (p == nullptr) throw py::error_already_set();
    if (!t.add(std::string(p, static_cast<size_t>(len))))
      throw py::value_error("TokenIds.sync: tokens[" + std::to_string(i) + "] = '" + std::string(p, len) +
                            "' is already in the table (vocabulary tokens must be distinct)");
  }
}

// TokenIds.encode: (terms int32 [T], cnt float64 [T], ptr int64 [b + 1]) of b texts, or
// None when a text is not ASCII (the caller's regex path handles those).
py::object token_ids_encode(const rfmem::TokenIds& t, const py::sequence& texts) {
  const size_t b = texts.size();
  std::vector<const char*> ps(b, nullptr);
  std::vector<size_t> ls(b, 0);
  bool ascii = true;
  for (size_t i = 0; i < b; ++i) {
    const py::handle o = texts[i];
    if (o.is_none()) continue;
    if (!py::isinstance<py::str>(o))
      throw py::type_error("texts[" + std::to_string(i) + "] must be a str or None, got " +
                           std::string(py::str(py::type::handle_of(o).attr("__name__"))));
    ascii = ascii && PyUnicode_IS_ASCII(o.ptr());
    if (!ascii) continue;  // (the remaining texts are still type-checked)
    Py_ssize_t len = 0;
    ps[i] = PyUnicode_AsUTF8AndSize(o.ptr(), &len);
    ls[i] = static_cast<size_t>(len);
  }
  if (!ascii) return py::none();
  std::vector<int32_t> terms;
  std::vector<double> cnt;
  std::vector<int64_t> ptr;
  t.encode(ps, ls, terms, cnt, ptr);
  py::array_t<int32_t> o_t(static_cast<py::ssize_t>(terms.size()));
  py::array_t<double> o_c(static_cast<py::ssize_t>(cnt.size()));
  py::array_t<int64_t> o_p(static_cast<py::ssize_t>(ptr.size()));
  std::copy(terms.begin(), terms.end(), o_t.mutable_data());
  std::copy(cnt.begin(), cnt.end(), o_c.mutable_data());
  std::copy(ptr.begin(), ptr.end(), o_p.mutable_data());
  return py::make_tuple(o_t, o_c, o_p);
}

PYBIND11_MODULE(_native, mod) {
  mod.doc() =
      "C++17 CPU kernels of rfmem_fast (the 'native' backend; RFMEM_SPEC.md, DESIGN.md 'The primitives every "
      "backend provides').\n\n"
      "Every function takes numpy arrays of exact dtypes, C-contiguous (zero-copy views of torch CPU tensors via "
      "tensor.numpy()), raises TypeError (wrong type / dtype) or ValueError (wrong rank, shape, contiguity or "
      "values) before any work, and releases the GIL while it computes. num_threads is the most threads a call may use (0 = the machine's); a "
      "call uses fewer when its work is too small to pay for them (common.h threads_for), when another call of the "
      "process holds the thread pool or when no core is idle; the pool's helper threads sleep between calls "
      "(pool.h: nothing spins) and a call never waits for a helper to be scheduled.";

  mod.def("segmented_topk", &py_segmented_topk, py::arg("X"), py::arg("offsets"), py::arg("Q"), py::arg("qseg"),
          py::arg("k"), py::arg("num_threads") = 0, py::arg("xnorm") = -1.0, py::arg("scan") = py::none(),
          py::arg("scan_type") = "float32", py::arg("path") = "auto", py::arg("qsel") = py::none(),
          py::arg("sel_seg") = py::none(), py::arg("sel_off") = py::none(), py::arg("sel_rows") = py::none(),
          py::arg("sel_mask") = py::none(), py::arg("sel_mask_off") = py::none(), py::arg("scan_meta") = py::none(),
          R"doc(Top-k inner products of each query within its own user's segment (spec "Vectors and scores").

Args:
    X: float32 [n, d] bank rows, C-contiguous.
    offsets: int64 [U + 1] CSR offsets, non-decreasing, offsets[0] >= 0, offsets[U] <= n;
        segment u owns rows offsets[u]:offsets[u + 1].
    Q: float32 [b, d] queries, C-contiguous.
    qseg: int64 [b] segment of each query, in [0, U).
    k: int >= 1.
    num_threads: most threads to use (0 = the machine's; fewer for small work).
    xnorm: an upper bound of the row norms of X (the error bound of the scan uses it);
        < 0 (default): computed here, one O(n d) pass.
    scan: None (default: the scan reads X), or a half-precision copy of X: uint16 [n, d]
        C-contiguous holding the float16 or bfloat16 bits of X rounded to nearest even
        (numpy ``X.astype(np.float16).view(np.uint16)``; torch ``.to(torch.bfloat16)``).
        The scan then reads these 2-byte rows (half the bytes), and X is read only for
        the candidates it re-scores exactly; the results are those of X.
        Or an int8 copy: int8 [n, d] (rfmem_fast.precision.to_scan_copy(X, "int8")), with
        scan_meta float32 [n, 3] (per row: the scale s, an upper bound of ||X[r] - s
        scan[r]||, an upper bound of ||X[r]||): a quarter of the bytes, integer dot
        products with per-query int16 queries, a proven bound per (query, row)
        (rfmem_fast/backends/exact.py "int8 scan copies"); the results are those of X.
    scan_type: "float32" (no scan copy), "float16", "bfloat16" or "int8" (the type of ``scan``).
    scan_meta: None, or (scan_type "int8" only, required there) the int8 copy's per-row data.
    path: "auto" (default: per segment, the cheaper of the scan and GEMM paths by the
        cost rule, see gemm_pays), "scan" or "gemm" (forced; results are the same).
    qsel, sel_seg, sel_off, sel_rows, sel_mask, sel_mask_off: a filtered search (all six,
        or none; rfmem_fast.filters.RowSelection.native_table): P selections, selection p
        the increasing rows sel_rows[sel_off[p]:sel_off[p + 1]] of segment sel_seg[p]
        (int64); sel_mask_off[p] = -1 (list mode: only the listed rows are scored) or the
        offset in sel_mask (uint8) of a mask over the segment's rows marking exactly them
        (mask mode: the segment is scanned and its unselected rows never kept); qsel
        (int64 [b]) the selection of each query, -1 for none, in the query's segment. A
        filtered query's result is the exact top-k of its selected rows (padded when
        fewer than k).

Returns:
    (scores float32 [b, k] descending, rows int64 [b, k] global row indices). A score is
    RN32(q . x), the exact inner product rounded once to float32 (a float32 scan keeps
    k + 8 candidates; every row that can reach the top k within the scan's proven error
    bound is re-scored exactly, see rfmem_fast/backends/exact.py).
    Ties are broken by the smaller row (the order of a stable sort by descending score);
    where a segment has fewer than k rows the tail is -inf / -1. Rows scoring NaN or
    -inf are never returned. The result of a query does not depend on the other queries
    of the batch, on num_threads or on the CPU.

Raises:
    TypeError: an argument is not a numpy array or has the wrong dtype.
    ValueError: wrong rank, shape or contiguity; malformed offsets; qseg out of range; k < 1;
        an unknown path or scan_type, a scan copy of another shape than X, or a scan_type
        that does not match whether ``scan`` is given; an int8 copy without scan_meta of
        shape [n, 3], or scan_meta with another scan type; malformed selections (only some of
        the six arrays, rows outside their segment or not increasing, a mask that does not
        mark exactly the rows, a qsel out of range or naming another segment).
)doc");

  mod.def("probe", &py_probe, py::arg("X"), py::arg("offsets"), py::arg("Q"), py::arg("qseg"), py::arg("k"),
          py::arg("probe_k"), py::arg("temperature"), py::arg("convention") = "mean", py::arg("num_threads") = 0,
          py::arg("xnorm") = -1.0, py::arg("scan") = py::none(), py::arg("scan_type") = "float32",
          py::arg("path") = "auto", py::arg("qsel") = py::none(), py::arg("sel_seg") = py::none(),
          py::arg("sel_off") = py::none(), py::arg("sel_rows") = py::none(), py::arg("sel_mask") = py::none(),
          py::arg("sel_mask_off") = py::none(), py::arg("keep_scan_scores") = false, py::arg("scan_meta") = py::none(),
          py::arg("hit_ptr") = py::none(), py::arg("hit_rows") = py::none(), py::arg("hx") = py::none(),
          py::arg("hval") = py::none(), py::arg("kf") = 0, py::arg("hscale") = py::none(),
          py::arg("hden") = py::none(),
          R"doc(segmented_topk fused with the familiarity signals of its first probe_k scores (spec section 1).

Args:
    X, offsets, Q, qseg, k, num_threads, xnorm, scan, scan_type, scan_meta, path, qsel, sel_seg,
        sel_off, sel_rows, sel_mask, sel_mask_off: as segmented_topk (a filtered query's
        signals are those of its selected rows' top-k).
    probe_k: K of the signals (>= 1; capped at k).
    temperature: lam of the softmax (finite).
    convention: "mean" | "sum" | "normalized" (rfmem_fast.signals.familiarity_signals).

Returns:
    (scores float32 [b, k], rows int64 [b, k], mean float64 [b], entropy float64 [b],
     count int64 [b]) where count = valid (finite) probe scores, mean = their average,
    entropy = the softmax entropy of lam * (s_i - s_1) in the chosen convention, all in
    float64 as familiarity_signals; a row without hits has mean 0 and entropy 0.
    With keep_scan_scores=True, two more: scan_scores float32 [b, L] (L = the longest
    queried segment) and written bool [b], or (None, None) unless L >= PRUNE_MIN_ROWS
    (the driver's pruning threshold) and b * L <= 2^22: for a query whose scan took the
    scan path over the float32 rows or a half-precision copy (SIMD level >= 1; not GEMM)
    or over the int8 copy (any level; not GEMM), written[i] and scan_scores[i, j] = the
    scan score of row offsets[qseg[i]] + j (float32 rows or a half copy: within that scan
    path's error bound of the exact score; int8 copy: its key, an upper bound of the exact
    score, as int8_bounds' upper), for the beam driver (recollect's ref_scores, with the
    same scan copy); other entries unspecified.
    With hit_ptr (int64 [b + 1]) and hit_rows (int32 [H]: each query's lexical hits,
    ascending local rows of its segment, as bm25_hits gives them), two more last:
    hit_keys float32 [H] and hit_up float64 [b] with hit_keys[h] + hit_up[i] >= the exact
    score RN32(Q[i] . x) of each hit x of query i, taken in the same pass (a scan or GEMM
    score and its path's bound, or an int8 key with offset 0); hit_up[i] = inf where the
    query's path records none (hit_keys NaN): fused_topk's hf / hup.
    With kf > 0 (1 <= kf <= k; needs the hits, hx float64 [H] finite boosts >= 0 and hval
    float64 [H] BM25, no qsel), four more last: each query's exact fused top-kf (rows int64,
    fused float64, dense float32, lex float64, [b, kf]) equal to fused_topk(dense_scores=
    scores, dense_rows=rows, hf=hit_keys, hup=hit_up), taken on the scan's threads right
    after the query's dense list (lexical.h FusedTopk), its segment and keys still in cache.
    The boosts may come as per-query factors instead of hx: hscale float64 [b] and hden
    float64 [b] or None, hit h of query i getting hscale[i] * (hval[h] / hden[i]) (0 where
    hden[i] <= 0), or hscale[i] * hval[h] without hden (rfmem_fast.fusion.apply_boost, the
    same float64 operations: the same bits as hx = BoostFactors.flat(hval, hit_ptr)),
    computed on the scan's threads.

Raises:
    TypeError, ValueError: as segmented_topk; probe_k < 1, non-finite temperature or an
    unknown convention (ValueError); malformed hits or boosts, kf < 0 or > k, kf > 0
    without hits or with qsel, hx / hval / hscale without kf, both hx and hscale, hden
    without hscale, boosts from the factors that are not finite and >= 0 (ValueError).
)doc");

  mod.def("batched_kmeans", &py_batched_kmeans, py::arg("V"), py::arg("counts"), py::arg("clusters"),
          py::arg("iters"), py::arg("tol"), py::arg("draws"), py::arg("num_threads") = 0,
          R"doc(Many small KMeans problems in one call (spec section 4), as rfmem_fast.kmeans.lloyd computes them.

Problem i clusters the points V[i, :counts[i]] into clusters[i] groups, replaying
scikit-learn's KMeans(n_init=1): greedy k-means++ seeding driven by the uniforms
draws[i] (scikit-learn's RandomState(seed) draws, see rfmem_fast.kmeans.sklearn_draws:
first centre searchsorted(cdf, u_0, right), then for centre t the 2 + int(ln k)
candidates searchsorted(cumsum(D2), u * sum(D2)) capped at count - 1, the one of smallest
resulting potential winning, first on ties), then Lloyd steps until the labels repeat
(strict convergence), the squared centre shift is <= tol * mean variance of the points,
or `iters` steps; argmin ties go to the smaller cluster index; without strict
convergence the labels are recomputed from the final centres.

Args:
    V: float32 [m, n, d], C-contiguous.
    counts: int64 [m], 1 <= counts[i] <= n.
    clusters: int64 [m], 1 <= clusters[i] <= counts[i].
    iters: Lloyd iteration cap (>= 0).
    tol: relative tolerance (finite, >= 0).
    draws: float64 [m, W] uniforms in [0, 1); row i needs at least
        1 + (k - 1) * (2 + int(ln k)) of them, k = clusters[i] (kmeanspp_draws(k)).
    num_threads: most threads to use (0 = the machine's; fewer for small work).

Returns:
    (labels int64 [m, n]: cluster of each valid point, -1 for padding; centroids float32
     [m, c, d], c = max(clusters): the mean of the members of each cluster under those
     labels, 0 for an empty or unused cluster).

Raises:
    TypeError: wrong type / dtype.
    ValueError: wrong rank / shape / contiguity, counts or clusters out of range, too few
    draws, iters < 0, tol < 0 or not finite.
)doc");

  mod.def("alpha_mix", &py_alpha_mix, py::arg("qb"), py::arg("centroids"), py::arg("q0"), py::arg("alpha"),
          py::arg("num_threads") = 0,
          R"doc(The child queries of each branch (spec section 4).

q_child[i, c] = normalise(alpha * qb[i] + (1 - alpha) * normalise(centroids[i, c]) + q0[i]),
normalise(v) = v / (||v|| + 1e-12), computed in float64 and rounded to float32.

Args:
    qb: float32 [m, d] branch queries.
    centroids: float32 [m, c, d].
    q0: float32 [m, d] original query of each branch.
    alpha: finite float.
    num_threads: most threads to use (0 = the machine's; fewer for small work).

Returns:
    float32 [m, c, d].

Raises:
    TypeError: wrong type / dtype. ValueError: wrong rank / shape / contiguity, non-finite alpha.
)doc");

  mod.def("unit_rows", &py_unit_rows, py::arg("X"), py::arg("eps"), py::arg("num_threads") = 0,
          R"doc(The rows of X divided by their L2 norms (RFMEM_SPEC.md "Vectors and scores").

out[r, j] = RN32(X[r, j] / ||X[r]||) with the norm the square root of the float64 squares
summed in numpy's pairwise order and the division in float64: bit for bit
``(X / np.sqrt(np.add.reduce(np.square(X, dtype=np.float64), axis=1, keepdims=True))).astype(np.float32)``.

Args:
    X: float32 [n, d], C-contiguous.
    eps: float >= 0: a row needs a norm in (eps, inf).
    num_threads: most threads to use (0 = the machine's; fewer for small work).

Returns:
    (out float32 [n, d], bad): bad is -1, or the first row whose norm is not in (eps, inf)
    (NaN / Inf values or a zero row); out is then unusable.

Raises:
    TypeError: wrong type / dtype. ValueError: wrong rank or contiguity, eps < 0 or NaN.
)doc");

  mod.def("max_similarity", &py_max_similarity, py::arg("V"), py::arg("counts"), py::arg("num_threads") = 0,
          R"doc(The MMR similarity of many point sets (spec section 4): each point's largest inner product with another point of its set.

The function the native beam driver (recollect) uses, so that the Python driver over the
native backend gives the same MMR scores bit for bit.

Args:
    V: float32 [m, n, d], C-contiguous; set i holds V[i, :counts[i]].
    counts: int64 [m], 0 <= counts[i] <= n.
    num_threads: most threads (0 = the machine's; fewer for small work).

Returns:
    float64 [m, n]: for j < counts[i] the largest <V[i, j], V[i, l]> over l < counts[i],
    l != j (float64 sum of the exact products, in a fixed order), -inf when the point is
    alone and for j >= counts[i].

Raises:
    TypeError: wrong type / dtype. ValueError: wrong rank / contiguity, counts out of range.
)doc");

  mod.def("recollect", &py_recollect, py::arg("X"), py::arg("offsets"), py::arg("Q0"), py::arg("qseg"),
          py::arg("level0_scores"), py::arg("level0_rows"), py::arg("beam_width"), py::arg("fanout"),
          py::arg("max_rounds"), py::arg("out_k"), py::arg("alpha"), py::arg("mmr_lambda"), py::arg("score_floor"),
          py::arg("kmeans_iters"), py::arg("kmeans_tol"), py::arg("draws"), py::arg("width"),
          py::arg("num_threads") = 0, py::arg("xnorm") = -1.0, py::arg("memory_budget") = int64_t{256} << 20,
          py::arg("active") = py::none(), py::arg("scan") = py::none(), py::arg("scan_type") = "float32",
          py::arg("path") = "auto", py::arg("qsel") = py::none(), py::arg("sel_seg") = py::none(),
          py::arg("sel_off") = py::none(), py::arg("sel_rows") = py::none(), py::arg("sel_mask") = py::none(),
          py::arg("sel_mask_off") = py::none(), py::arg("stats") = py::none(), py::arg("ref_scores") = py::none(),
          py::arg("ref_ok") = py::none(), py::arg("dense") = false, py::arg("scan_meta") = py::none(),
          R"doc(The whole Recollection path (spec section 4) for a batch of queries: the native beam driver.

The C++ twin of rfmem_fast.recollection.recollect (the Python driver): same rows, scores
and rounds. Each query runs all its rounds on one thread (its user's rows stay in cache);
queries are spread over the thread pool. On segments of PRUNE_MIN_ROWS rows or more, the
rounds' top-k calls skip the rows that provably cannot reach a branch's top-k (the scan
scores of the original query: ref_scores, or one scan here).

Args:
    X, offsets: the bank, as segmented_topk.
    Q0: float32 [b, d] original (unit) queries; qseg: int64 [b] segment of each query.
    level0_scores, level0_rows: float32 / int64 [b, k0] (k0 >= beam_width * fanout) the
        probe's top-k of Q0 (rows -1 or in the query's segment), reused as the first
        round's candidates; or both None (searched here).
    beam_width, fanout, max_rounds (1..64), out_k (>= 1), alpha (finite), mmr_lambda
        ([0, 1]), score_floor (finite; compared with the float32 scores in float32),
        kmeans_iters (0..1000), kmeans_tol (>= 0): RFMemConfig's fields.
    draws: float64 [beam_width + 1, W]: row k holds scikit-learn's uniforms for k clusters
        (rfmem_fast.kmeans.sklearn_draws), W >= kmeanspp_draws(beam_width).
    width: result columns (>= 1): out_k for the result; out_k - 1 + B (B + R - 1) F (or
        more, padding) for every item the beam discovered, in discovery order.
    num_threads: most threads (0 = the machine's; fewer for small work; a single query
        runs on the calling thread).
    xnorm: an upper bound of the row norms of X (< 0: computed here).
    memory_budget: bytes for the per-thread workspaces (threads are capped so that they
        fit; one thread at least).
    active: bool [b] or None (all): queries with False are not recollected (padding rows,
        -inf scores, 0 rounds, no work).
    scan, scan_type, scan_meta, path: the rounds' top-k calls, as segmented_topk's (a
        half-precision or int8 scan copy of X, its type, the int8 copy's per-row data, a
        forced path); the results do not depend on them.
    qsel, sel_seg, sel_off, sel_rows, sel_mask, sel_mask_off: a filtered search, as
        segmented_topk's (qsel per query of the batch): every round's candidates of a
        filtered query come from its selected rows (level0 must be filtered alike).
    ref_scores, ref_ok: None, or probe(keep_scan_scores=True)'s scan_scores and written for
        these queries: float32 [b, >= the longest queried segment], bool [b]. The rounds
        of a long segment are pruned with the scan scores of the original query; where
        ref_ok[i] they are taken from here instead of scanning Q0[i] again. Results never
        depend on them, PROVIDED they are the scan scores of Q0 (the caller's contract:
        probe(keep_scan_scores=True)'s with the same scan copy as this call: within that
        scan's bound of RN32(Q0[i] . x), or upper bounds of it, as the int8 copy's keys).
    dense: also return the exact dense scores RN32(Q0[i] . X[row]) of each query's first
        out_k result rows (float32 [b, out_k], NaN padding and for inactive queries).
    stats: None, or a writeable float64 [recollect_stat_names length] array to which the
        call ADDS its profile: seconds of the whole call and of its phases (summed over
        threads), then counts; names in recollect_stat_names (timed only when given).

Returns:
    (rows int64 [b, width] in discovery order, -1 padding; scores float32 [b, width], the
     (MMR-adjusted) score each item was discovered with, -inf padding; rounds int64 [b],
     rounds that produced a beam), and with dense=True a fourth: the dense scores.

Raises:
    TypeError: wrong type / dtype. ValueError: wrong shape / contiguity, malformed
    offsets, qseg or level0 rows out of range, a setting out of its range, a draws table
    too small, bad scan / scan_type / path (as segmented_topk). MemoryError: a workspace
    could not be allocated.
)doc");

  py::class_<rfmem::TokenIds>(mod, "TokenIds", R"doc(The query tokenizer of the lexical channel, native (tokenize.h).

A mirror of a bank's Vocabulary (token -> int32 id, ids in order of insertion), kept in
step with ``sync``, and the stopwords it drops. ``encode`` gives what
rfmem_fast.lexical.LexicalIndex.encode_queries gives without a stemmer, for ASCII texts.

Args:
    stopwords: list of str (rfmem_fast.lexical.STOPWORDS_EN).
)doc")
      .def(py::init([](const py::list& words) {
             std::vector<std::string> v;
             for (const py::handle w : words) v.push_back(py::cast<std::string>(w));
             return new rfmem::TokenIds(v);
           }),
           py::arg("stopwords"))
      .def("__len__", &rfmem::TokenIds::size, "Number of tokens held (the next id).")
      .def("sync", &token_ids_sync, py::arg("tokens"),
           R"doc(Append the tokens of ``tokens`` past len(self), in order (id = list position).

Args:
    tokens: list of str, the Vocabulary's tokens (append-only: its first len(self) entries
        are those already held).

Raises:
    TypeError: a token is not a str. ValueError: a token is already held (not distinct).
)doc")
      .def("encode", &token_ids_encode, py::arg("texts"),
           R"doc(Tokenise b query texts and look their tokens up.

Per text: lowercased, split at every character outside [a-z0-9_] (runs of 2 or more kept,
rfmem_fast.lexical.TOKEN_PATTERN on ASCII), stopwords dropped, then its distinct known
token ids in order of first occurrence and how often each occurs.

Args:
    texts: sequence of b str or None (None: no token).

Returns:
    (terms int32 [T], counts float64 [T], ptr int64 [b + 1]) in CSR form (text i:
    terms[ptr[i]:ptr[i + 1]]), or None when a text is not ASCII.

Raises:
    TypeError: texts[i] is neither a str nor None.
)doc");
  mod.def("bm25_hits", &py_bm25_hits, py::arg("users"), py::arg("quser"), py::arg("qterms"), py::arg("qcnt"),
          py::arg("qptr"), py::arg("num_threads") = 0,
          R"doc(BM25 hits of b queries in their users' postings (the lexical channel, rfmem_fast.lexical).

Args:
    users: list of (terms int32 [T] ascending, ptr int64 [T + 1], rows int32 [P] local rows,
        weight float64 [P], n_rows int): rfmem_fast.lexical.UserPostings' arrays.
    quser: int64 [b] index into users of each query's user (< 0: no postings).
    qterms: int32 [sum T_i] every query's distinct known token ids (first-occurrence order),
        concatenated; qcnt: float64, their counts; qptr: int64 [b + 1] CSR pointers.
    num_threads: most threads (0 = the machine's; a batch's queries in parts of 16 per
        thread, results independent of it).

Returns:
    (hptr int64 [b + 1], hrows int32 [H] local rows ascending per query, hval float64 [H]
     BM25 > 0, max float64 [b], top float64 [b, 10] largest first (0 padding), sum and
     sumsq float64 [b]: sums of the BM25 and of its squares in row order). The BM25 of a
     row is the float64 sum, in query-term order, of qtf * w(t, d): equal, bit for bit,
     to UserPostings.scores.

Raises:
    TypeError: wrong dtype. ValueError: wrong shapes, malformed pointers, rows out of range.
)doc");
  mod.def("fused_topk", &py_fused_topk, py::arg("X"), py::arg("offsets"), py::arg("Q"), py::arg("qseg"),
          py::arg("dense_scores"), py::arg("dense_rows"), py::arg("hptr"), py::arg("hrows"), py::arg("hx"),
          py::arg("hval"), py::arg("kf"), py::arg("num_threads") = 0, py::arg("xnorm") = -1.0,
          py::arg("hf") = py::none(), py::arg("hup") = py::none(),
          R"doc(The exact fused top-kf of the dense and lexical channels (rfmem_fast.fusion).

fused = RN32(q.x) + x, x >= 0 the boost of a lexical hit (0 elsewhere). From each query's
exact dense top-K and its hits, as rfmem_fast.search._hybrid_batched (the fusion docstring
proves the result is the fused top-kf of the whole segment): hits outside the dense list
are screened with a float32 scan score and its error bound and re-scored exactly only when
they can still reach the kf-th fused score of the dense list.

Args:
    X, offsets, Q, qseg: the bank and the (unit) queries, as segmented_topk.
    dense_scores float32 / dense_rows int64 [b, K]: the exact dense top-K of each query
        (-inf / -1 padding), ordered by (score desc, row asc).
    hptr int64 [b + 1], hrows int32 [H] (ascending local rows per query), hx float64 [H]
        (finite boosts >= 0), hval float64 [H] (BM25): each query's lexical hits.
    kf: width (>= 1). num_threads: most threads (0 = the machine's). xnorm: bound of the
        row norms (< 0: computed).
    hf: float32 [H] or None: the hits' float32 scan scores as hybrid_probe records them
        (used instead of computing them; any other value breaks exactness), or with hup
        the hits' keys as probe(hit_ptr=, hit_rows=) gives them.
    hup: float64 [b] or None: with hf, each query's offset (>= 0) that makes its keys
        upper bounds of the exact scores (hf[h] + hup[i] >= RN32(q_i . x)); inf: the
        query's keys were not recorded (the kernel scores its hits itself). None: hf
        are float32 scan scores within the scan bound (hybrid_probe's).

Returns:
    (rows int64 [b, kf] (-1 padding), fused float64 (-inf), dense float32 (NaN), lex
     float64 (BM25, 0 for no hit; NaN padding)), ordered by (fused desc, row asc).

Raises:
    TypeError: wrong dtype. ValueError: wrong shapes, rows outside the query's segment,
    unsorted hits, negative or non-finite boosts, kf < 1.
)doc");
  mod.def("context_topk", &py_context_topk, py::arg("X"), py::arg("offsets"), py::arg("Q"), py::arg("qseg"),
          py::arg("f"), py::arg("fptr"), py::arg("boosts"), py::arg("quser"), py::arg("lay"), py::arg("lay_ptr"),
          py::arg("tstart"), py::arg("t_ptr"), py::arg("fstart"), py::arg("r"), py::arg("w_n"), py::arg("w_s"),
          py::arg("k"), py::arg("scale"), py::arg("abs_term"), py::arg("xnorm"), py::arg("num_threads") = 0,
          R"doc(The context score's exact top-k of unfiltered queries on users without chunk rows
(rfmem_fast.context.context_topk's compiled path; the definition and the proof are there).

Args:
    X: float32 [n, d] rows; offsets: int64 [U + 1]; Q: float32 [b, d]; qseg: int64 [b].
    f: float32 [F] every segment row's scan score, query after query (fptr: int64 [b + 1]),
        |f - RN32(q.x)| <= scale ||q|| (1 + 2^-30) + abs_term.
    boosts: float64 [F] every row's fusion boost (>= 0), or None.
    quser: int64 [b] each query's layout (-1: the query is skipped, its row padding); lay
        int32 / lay_ptr int64: the layouts' local item
        rows (-1: sentinel); tstart int32 / t_ptr int64: their thread blocks' first
        positions; fstart: int64 each layout's free block.
    r, w_n, w_s: the config's radius and weights; k: the width; xnorm: the rows' largest norm
        (an upper bound).

Returns:
    (rows int64 [b, k] (-1 padding), c float64 [b, k] (NaN), base float64 [b, k] (-inf),
    dense float32 [b, k] (NaN)), by (c desc, row asc).
)doc");
  mod.def("hybrid_probe", &py_hybrid_probe, py::arg("X"), py::arg("offsets"), py::arg("Q"), py::arg("qseg"),
          py::arg("k"), py::arg("probe_k"), py::arg("temperature"), py::arg("convention"), py::arg("hptr"),
          py::arg("hrows"), py::arg("hx"), py::arg("hval"), py::arg("kf"), py::arg("num_threads") = 0,
          py::arg("xnorm") = -1.0,
          R"doc(probe and the fused top-kf of the lexical channel in ONE pass over each query's segment.

Every row's float32 scan score feeds the dense top-k (as probe: exact scores, the familiarity
signals of its first probe_k) and the fused top-kf, by fused = RN32(q.x) + x (x the boost of
the row's lexical hit, 0 elsewhere), re-scored exactly (csrc/cpu/topk.cpp, hybrid_probe).

Args:
    X, offsets, Q, qseg, k, probe_k, temperature, convention: as probe (the float32 rows are
        scanned).
    hptr, hrows, hx, hval, kf: the queries' lexical hits and boosts and the fused width, as
        fused_topk.
    num_threads, xnorm: as probe.

Returns:
    (scores, rows, mean, ent, count) as probe, then (rows, fused, dense, lex) [b, kf] as
    fused_topk (kf = 0: no fused list, hx unused), then hf float32 [H]: every hit's float32
    scan score (fused_topk's ``hf``).

Raises:
    TypeError: wrong dtype. ValueError: wrong shapes, unsorted hits, negative or non-finite
    boosts, k / probe_k < 1, kf < 0, unknown convention.
)doc");
  mod.def(
      "kmeanspp_draws",
      [](int64_t k) {
        if (k < 1) throw py::value_error("kmeanspp_draws: k must be >= 1, got " + std::to_string(k));
        return rfmem::kmeanspp_draws(k);
      },
      py::arg("k"),
      "Uniform draws the k-means++ seeding of k clusters reads: 1 + (k - 1) * (2 + int(ln k)).\n\n"
      "Raises ValueError when k < 1.");
  mod.def(
      "max_threads", []() { return rfmem::hardware_threads(); },
      "Most threads a call with num_threads=0 may use: std::thread::hardware_concurrency().");
  mod.def(
      "threads_for",
      [](int num_threads, double work, int64_t items) { return rfmem::threads_for(num_threads, work, items); },
      py::arg("num_threads"), py::arg("work"), py::arg("items"),
      "Threads a kernel uses for `work` multiply-adds over `items` independent items when allowed `num_threads` "
      "(0 = the machine's): at most one per kMinWorkPerThread multiply-adds and per item, at least 1.");
  mod.attr("MIN_WORK_PER_THREAD") = rfmem::kMinWorkPerThread;
  // a pool helper's spin after a region begun within this many seconds of the previous one's end (pool.h)
  mod.attr("HELPER_SPIN_SECONDS") = rfmem::kHelperSpinSeconds;
  // a call of fewer multiply-adds that finds the helpers asleep after an idle gap runs alone (pool.h)
  mod.attr("ALONE_AFTER_GAP_WORK") = rfmem::kAloneAfterGapWork;
  mod.attr("PRUNE_MIN_ROWS") = rfmem::kPruneMinRows;
  mod.def(
      "set_thread_pool",
      [](const std::string& mode) {
        rfmem::PoolMode m;
        if (mode == "auto") m = rfmem::PoolMode::kAuto;
        else if (mode == "always") m = rfmem::PoolMode::kAlways;
        else if (mode == "per-call") m = rfmem::PoolMode::kPerCall;
        else throw py::value_error("set_thread_pool: mode must be one of ('auto', 'always', 'per-call'), got '" + mode + "'");
        const rfmem::PoolMode prev = rfmem::set_thread_pool(m);
        return std::string(prev == rfmem::PoolMode::kAuto ? "auto" : prev == rfmem::PoolMode::kAlways ? "always" : "per-call");
      },
      py::arg("mode"),
      "Process-wide, how the kernels' parallel regions get their threads (csrc/cpu/pool.h): 'auto' (default) the "
      "pool of sleeping helper threads, with helpers only for the cores idle at the last sample of /proc/loadavg "
      "(every 2 ms at most); 'always' the pool whatever the load; 'per-call' threads started for each region and "
      "joined at its end (the behaviour before the pool). Returns the previous mode. Results never depend on it.");
  mod.def("idle_cpus", []() { return rfmem::idle_cpus(); },
          "CPUs idle at the last sample (online CPUs minus running tasks, /proc/loadavg; at most every 2 ms).");
  mod.def(
      "_idle_count",
      [](const std::string& loadavg, int cpus, int own) {
        if (cpus < 1) throw py::value_error("cpus must be >= 1, got " + std::to_string(cpus));
        return rfmem::idle_count(cpus, rfmem::loadavg_running(loadavg.c_str()), own);
      },
      py::arg("loadavg"), py::arg("cpus"), py::arg("own") = 0,
      "idle_cpus()'s formula on a given /proc/loadavg text (tests): cpus minus the text's running tasks plus the "
      "pool's own awake helpers ``own``, clamped to [0, cpus]; cpus when the text is not of /proc/loadavg's form.");
  mod.def(
      "pool_counters",
      []() {
        const rfmem::PoolCounters c = rfmem::pool_counters();
        py::dict d;
        d["regions"] = c.regions;
        d["inline_taken"] = c.inline_taken;
        d["items_caller"] = c.items_caller;
        d["items_helper"] = c.items_helper;
        d["waits"] = c.waits;
        d["inline_busy"] = c.inline_busy;
        d["idle_samples"] = c.idle_samples;
        d["spin_regions"] = c.spin_regions;
        d["helpers"] = c.helpers;
        d["awake_helpers"] = rfmem::pool_awake_helpers();
        return d;
      },
      "Counters of the thread pool since the process started (or forked): regions run on it, regions run alone "
      "because it was taken, items run by callers and by helpers, regions whose caller slept for a helper's item, "
      "regions run alone because no core was idle, samples of the idle CPUs taken, regions begun within "
      "HELPER_SPIN_SECONDS of the previous one's end (their helpers spin for the next region before they sleep), "
      "helper threads started; and awake_helpers: the helpers awake now (in a region or spinning for the next).");
  // recollect's stats: seconds of the call and its phases, then counts (recollect.h RecollectStat)
  static_assert(rfmem::kRecollectStats == 12, "recollect_stat_names lists every RecollectStat");
  mod.attr("recollect_stat_names") =
      py::make_tuple("total_s", "scan_s", "filter_s", "mmr_s", "kmeans_s", "mix_s", "select_s", "rounds",
                     "scan_queries", "branches", "kept", "scan_rows");
  mod.def(
      "simd_level", []() { return rfmem::simd_kernels().level; },
      "SIMD level the top-k kernels use now: 2 AVX-512F, 1 AVX2 + FMA + F16C, 0 baseline (csrc/cpu/simd.h); the "
      "highest this CPU supports unless capped by set_simd_cap.");
  mod.def(
      "set_simd_cap",
      [](int cap, int int8_cap) { return rfmem::set_simd_cap(cap, int8_cap); }, py::arg("cap"),
      py::arg("int8_cap") = -1,
      "Caps the SIMD level of later calls at ``cap`` (0, 1, 2; negative: no cap) and level 2's int8 kernels at "
      "``int8_cap`` (2 avx512_vnni, 1 avx512bw, 0 avx2: level 1's; negative, the default: no cap), and returns "
      "the level now in use. For tests and benchmarks (every level's kernels on one machine); results never "
      "depend on it.");
  mod.def(
      "set_int8_min_rows", [](int64_t rows) { return rfmem::set_int8_min_rows(rows); }, py::arg("rows"),
      "Sets the mean rows per queried segment from which a call reads the int8 scan copy (0: always; negative: "
      "the default, INT8_MIN_ROWS) and returns the value now in use; below it the call scans the float32 rows, "
      "where the int8 copy does not pay (csrc/cpu/kernels.h kI8MinRows, measured). For tests and benchmarks; "
      "results never depend on it.");
  mod.def(
      "set_int8_byte_queries", [](bool on, int64_t min_rows) { return rfmem::set_int8_byte_queries(on, min_rows); },
      py::arg("on"), py::arg("min_rows") = -1,
      "Turns the byte queries of the int8 GEMM path on (the default) or off, sets the segment length they start "
      "at (min_rows; negative: INT8_BYTE_MIN_ROWS) and returns the previous on / off. On, a call's GEMM units "
      "over int8 segments of at least min_rows rows quantise their queries to bytes (|code| <= 127) and score "
      "with vpdpbusd (avx512_vnni: twice vpdpwssd's multiply-adds), their kept rows re-keyed with the int16 "
      "codes before the exact finish (csrc/cpu/topk.cpp). For tests and benchmarks; results never depend on it.");
  mod.def(
      "int8_byte_queries", [](int64_t d) { return rfmem::int8_byte_queries(d); }, py::arg("d"),
      "Whether an int8 call of dimension d gives byte queries to its GEMM units over segments of "
      "int8_byte_min_rows() rows or more now: the avx512_vnni kernels in use, d a multiple of 4 and at most "
      "(2^31 - 1) / (255 * 127), set_int8_byte_queries on.");
  mod.def("int8_byte_min_rows", []() { return rfmem::int8_byte_min_rows(); },
          "The segment length from which int8 GEMM units take byte queries now (set_int8_byte_queries).");
  mod.attr("INT8_BYTE_MIN_ROWS") = rfmem::kI8ByteMinRows;
  mod.def("int8_min_rows", []() { return rfmem::int8_min_rows(); },
          "The mean rows per queried segment from which a call reads the int8 scan copy now (set_int8_min_rows).");
  mod.attr("INT8_MIN_ROWS") = rfmem::kI8MinRows;
  // the int8 copy's GEMM-vs-scan rule (levels 1, 2): GEMM from this many queries of one
  // segment of >= 128 rows (kernels.h kI8GemmMinQueries, measured)
  mod.attr("INT8_GEMM_MIN_QUERIES") = rfmem::kI8GemmMinQueries;
  mod.def(
      "simd_int8_kernel", []() { return std::string(rfmem::simd_kernels().i8_name); },
      "The int8 scan kernels (MemoryBank(dtype='int8')) in use now: 'avx512_vnni' (level 2, vpdpwssd; its GEMM "
      "units vpdpbusd with byte queries, int8_byte_queries), 'avx512bw' "
      "(level 2 without AVX512_VNNI), 'avx2' (level 1, and level 2 without AVX-512BW) or 'baseline' (level 0) "
      "(csrc/cpu/simd.h).");
  mod.def(
      "simd_int8_supported", []() { return rfmem::simd_i8_supported(); },
      "Highest int8 kernel variant of SIMD level 2 this CPU supports: 2 avx512_vnni, 1 avx512bw, 0 avx2 "
      "(set_simd_cap's int8_cap).");
  mod.def(
      "gemm_pays",
      [](int64_t nq, int64_t seg_len, int64_t d, int level) {
        if (level < 0) level = rfmem::simd_kernels().level;
        return rfmem::gemm_pays(nq, seg_len, d, level);
      },
      py::arg("num_queries"), py::arg("seg_len"), py::arg("d"), py::arg("level") = -1,
      "The cost rule of segmented_topk(path='auto'): True when num_queries queries of one segment of seg_len rows "
      "(dimension d) take the GEMM path at SIMD level ``level`` (-1: the level in use). GEMM costs the queries "
      "padded to whole panels (32 at level 2, 16 below) at the micro-kernel's rate, the scan path every query at "
      "the lanes' rate (csrc/cpu/topk.cpp, measured rates); segments of fewer than 128 rows always scan.");
  mod.attr("GEMM_KC") = rfmem::kGemmKc;
  mod.def(
      "int8_bounds",
      [](const py::object& codes_, const py::object& meta_, const py::object& Q_, double xnorm,
         const std::string& path) {
        const char* fn = "int8_bounds";
        if (path != "scan" && path != "gemm" && path != "bytes" && path != "gemm-bytes")
          throw py::value_error(std::string(fn) + ": path must be 'scan', 'gemm', 'bytes' or 'gemm-bytes', got '" +
                                path + "'");
        py::array codes = checked<int8_t>(codes_, fn, "codes", 2, "int8");
        py::array meta = checked<float>(meta_, fn, "meta", 2, "float32");
        py::array Q = checked<float>(Q_, fn, "Q", 2, "float32");
        const int64_t n = codes.shape(0), d = codes.shape(1), b = Q.shape(0);
        if (meta.shape(0) != n || meta.shape(1) != 3)
          throw py::value_error(std::string(fn) + ": meta must have shape (" + std::to_string(n) + ", 3), got " +
                                shape_str(meta));
        if (Q.shape(1) != d)
          throw py::value_error(std::string(fn) + ": Q must have " + std::to_string(d) + " columns (codes' d), got " +
                                shape_str(Q));
        if (!(xnorm >= 0.0)) throw py::value_error(std::string(fn) + ": xnorm must be >= 0 (an upper bound of ||x||)");
        py::array_t<float> lo({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(n)});
        py::array_t<float> up({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(n)});
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = rfmem::int8_bounds(cptr<int8_t>(codes), cptr<float>(meta), n, d, cptr<float>(Q), b, xnorm,
                                  lo.mutable_data(), up.mutable_data(), path == "gemm" || path == "gemm-bytes",
                                  path == "bytes" || path == "gemm-bytes");
        }
        if (!ok)
          throw py::value_error(std::string(fn) + ": the int8 scan cannot bound these queries (a non-finite query, "
                                "||q|| xnorm >= 2^100, or d > (2^31 - 1) / 127): segmented_topk scans the float32 "
                                "rows for them");
        return py::make_tuple(lo, up);
      },
      py::arg("codes"), py::arg("meta"), py::arg("Q"), py::arg("xnorm"), py::arg("path") = "scan",
      R"doc(The int8 scan's proven bounds of every (query, row) score (tests, diagnostics).

Args:
    codes: int8 [n, d], meta: float32 [n, 3] (rfmem_fast.precision.int8_scan_copy of float32
        rows X); Q: float32 [b, d]; xnorm: an upper bound of the rows' norms (>= 0).
    path: "scan" (default): both bounds from the scan path's int32 dots (simd.h i8_dots);
        "gemm": upper as the GEMM path's micro-kernel computes it (i8_gemm_panel: the keys
        its heaps receive; level 0 has none and uses i8_dots), lower as "scan" (the exact
        finish always takes it from i8_dots). "bytes" / "gemm-bytes": the same with the
        queries quantised to byte codes (|code| <= 127), the form the GEMM units take
        where int8_byte_queries(d) (upper from i8_gemm_panel_b's vpdpbusd there).

Returns:
    (lower float32 [b, n], upper float32 [b, n]): lower <= RN32(Q[i] . X[r]) <= upper, as
    segmented_topk's int8 scan computes them with the SIMD kernels in use (queries
    quantised to int16 per query, exact int32 dots, rfmem_fast/backends/exact.py "int8
    scan copies"); the same bits at every level and int8 kernel (simd_int8_kernel).

Raises:
    TypeError: wrong dtypes. ValueError: wrong shapes, an unknown ``path``, or
    queries the int8 scan cannot bound (then segmented_topk scans the float32 rows).
)doc");
}
