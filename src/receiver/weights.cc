#include "rolloutcore/receiver/weights.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace rc::receiver {

using formats::DTypeName;

namespace {
size_t PageSize() {
  static const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGE_SIZE));
  return kPage;
}
}  // namespace

Result<std::shared_ptr<WeightBuffer>> WeightBuffer::Allocate(size_t bytes) {
  const size_t page = PageSize();
  const size_t mapped = bytes == 0 ? page : (bytes + page - 1) / page * page;
  // Buffers of at least one huge page are 2 MiB aligned and asked to be backed by transparent
  // huge pages: mprotect then changes one entry per 2 MiB instead of one per 4 KiB (30 ms -> 0.1
  // ms for 1.2 GB here), and the kernels' weight reads take fewer TLB misses. The price is paid
  // once, when the pages are first touched (engine load, first stage): with the kernel's THP
  // defrag set to "madvise" a fragmented host compacts memory then (seconds for GBs).
  // ROLLOUTCORE_WEIGHT_HUGEPAGES=0 keeps small pages.
  const size_t huge = size_t{2} << 20;
  static const bool kHugePages = [] {
    const char* v = std::getenv("ROLLOUTCORE_WEIGHT_HUGEPAGES");
    return v == nullptr || std::string_view(v) != "0";
  }();
  const bool use_huge = kHugePages && bytes >= huge;
  const size_t reserve = use_huge ? mapped + huge : mapped;
  void* p = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Internal("cannot map " + std::to_string(bytes) + " bytes of weight memory: " + std::strerror(errno));
  }
  auto* base = static_cast<std::byte*>(p);
  std::byte* data = base;
  if (use_huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    data = base + ((huge - addr % huge) % huge);
    // Hand back the unaligned head and the tail beyond the aligned buffer.
    if (data > base) ::munmap(base, static_cast<size_t>(data - base));
    std::byte* end = data + mapped;
    if (base + reserve > end) ::munmap(end, static_cast<size_t>(base + reserve - end));
    (void)::madvise(data, mapped, MADV_HUGEPAGE);  // a hint: without it the buffer works on small pages
  }
  return std::shared_ptr<WeightBuffer>(new WeightBuffer(data, bytes, mapped));
}

WeightBuffer::~WeightBuffer() { ::munmap(data_, mapped_); }

Status WeightBuffer::SetReadOnly(bool read_only) {
  if (read_only == read_only_) return OkStatus();
  if (::mprotect(data_, mapped_, read_only ? PROT_READ : PROT_READ | PROT_WRITE) != 0) {
    return Internal("mprotect of " + std::to_string(mapped_) + " bytes of weight memory failed: " +
                    std::strerror(errno));
  }
  read_only_ = read_only;
  return OkStatus();
}

bool IsParameterDType(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status ParameterStore::Add(const std::string& name, std::vector<int64_t> shape, DType dtype) {
  if (params_.count(name) != 0) return AlreadyExists("parameter '" + name + "' already exists");
  if (!IsParameterDType(dtype)) {
    return InvalidArgument("parameter '" + name + "': dtype " + std::string(DTypeName(dtype)) +
                           " cannot be a parameter dtype (F32, BF16)");
  }
  Parameter p;
  p.name = name;
  p.dtype = dtype;
  p.numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("parameter '" + name + "': negative dimension");
    p.numel *= d;
  }
  p.shape = std::move(shape);
  RC_ASSIGN_OR_RETURN(p.storage, WeightBuffer::Allocate(p.nbytes()));
  params_.emplace(name, std::move(p));
  return OkStatus();
}

Status ParameterStore::Alias(const std::string& name, const std::string& target) {
  auto it = params_.find(target);
  if (it == params_.end()) return NotFound("parameter '" + target + "' to alias does not exist");
  Parameter p = it->second;
  p.name = name;
  p.alias_of = target;
  if (!params_.emplace(name, std::move(p)).second) {
    return AlreadyExists("parameter '" + name + "' already exists");
  }
  return OkStatus();
}

const Parameter* ParameterStore::Find(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

Result<const Parameter*> ParameterStore::Get(std::string_view name, const std::vector<int64_t>& expect_shape) const {
  const Parameter* p = Find(name);
  if (p == nullptr) return NotFound("engine parameter '" + std::string(name) + "' does not exist");
  if (p->shape != expect_shape) {
    return InvalidArgument("engine parameter '" + std::string(name) + "' has shape " + ShapeString(p->shape) +
                           ", expected " + ShapeString(expect_shape));
  }
  return p;
}

int64_t ParameterStore::TotalBytes() const {
  int64_t n = 0;
  for (const auto& [name, p] : params_)
    if (p.alias_of.empty()) n += static_cast<int64_t>(p.nbytes());
  return n;
}

Status ParameterStore::ExchangeStorage(std::string_view name, std::shared_ptr<WeightBuffer>* other) {
  auto it = params_.find(name);
  if (it == params_.end()) return NotFound("engine parameter '" + std::string(name) + "' does not exist");
  Parameter& p = it->second;
  if (!p.alias_of.empty()) {
    return InvalidArgument("engine parameter '" + std::string(name) + "' is an alias of " + p.alias_of +
                           "; exchange the storage of " + p.alias_of);
  }
  if (other == nullptr || *other == nullptr || (*other)->size() != p.nbytes()) {
    return InvalidArgument("exchanging the storage of '" + std::string(name) + "' (" + std::to_string(p.nbytes()) +
                           " bytes) needs a buffer of the same size, got " +
                           std::to_string(other && *other ? (*other)->size() : 0));
  }
  std::swap(p.storage, *other);
  for (auto& [n, q] : params_) {
    if (q.alias_of == p.name) q.storage = p.storage;
  }
  return OkStatus();
}

Status ParameterStore::SetReadOnly(bool read_only) {
  for (auto& [name, p] : params_) {
    if (p.alias_of.empty()) RC_RETURN_IF_ERROR(p.storage->SetReadOnly(read_only));
  }
  return OkStatus();
}

}  // namespace rc::receiver
