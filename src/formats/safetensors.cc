#include "rolloutcore/formats/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "rolloutcore/base/json.h"

namespace rc::formats {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF64: return "F64";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

Result<DType> DTypeFromName(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI64, DType::kI32,
                  DType::kI16, DType::kI8, DType::kU8, DType::kBool}) {
    if (DTypeName(d) == name) return d;
  }
  return InvalidArgument("unknown safetensors dtype '" + std::string(name) + "'");
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16: return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return 1;
  }
  return 1;
}

int64_t TensorEntry::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorEntry* SafetensorsHeader::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorEntry& e, std::string_view n) { return e.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

namespace {

uint64_t ReadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Result<uint64_t> GetU64(const Json& j, std::string_view what) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer()) {
    int64_t v = j.get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
  }
  return InvalidArgument(std::string(what) + ": expected a non-negative integer, got " +
                         JsonTypeName(j));
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix,
                                                 uint64_t file_size) {
  if (prefix.size() < 8 || file_size < 8) {
    return InvalidArgument("safetensors: file is " + std::to_string(file_size) +
                           " bytes, shorter than the 8-byte header length");
  }
  const uint64_t n = ReadLE64(prefix.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return InvalidArgument("safetensors: header length " + std::to_string(n) +
                           " exceeds the limit of " + std::to_string(kMaxSafetensorsHeaderBytes));
  }
  if (n > file_size - 8) {
    return InvalidArgument("safetensors: header length " + std::to_string(n) +
                           " runs past the end of the " + std::to_string(file_size) +
                           "-byte file");
  }
  if (prefix.size() < 8 + n) {
    return InvalidArgument("safetensors: need " + std::to_string(8 + n) +
                           " bytes to parse the header, have " + std::to_string(prefix.size()));
  }
  std::string_view text(reinterpret_cast<const char*>(prefix.data() + 8), n);
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(text, "safetensors header"));
  if (!j.is_object()) {
    return InvalidArgument("safetensors header: expected a JSON object, got " + JsonTypeName(j));
  }
  SafetensorsHeader h;
  h.data_offset = 8 + n;
  const uint64_t data_size = file_size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return InvalidArgument("safetensors __metadata__: expected an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return InvalidArgument("safetensors __metadata__." + m.key() + ": expected a string");
        }
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) return InvalidArgument("safetensors: empty tensor name");
    if (!v.is_object()) {
      return InvalidArgument("safetensors tensor '" + name + "': expected an object, got " +
                             JsonTypeName(v));
    }
    TensorEntry e;
    e.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) {
      return InvalidArgument("safetensors tensor '" + name + "'.dtype: expected a string");
    }
    auto dtype = DTypeFromName(dt->get<std::string>());
    if (!dtype.ok()) return dtype.status().WithContext("safetensors tensor '" + name + "'");
    e.dtype = *dtype;
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) {
      return InvalidArgument("safetensors tensor '" + name + "'.shape: expected an array");
    }
    if (sh->size() > 16) {
      return InvalidArgument("safetensors tensor '" + name + "'.shape: more than 16 dimensions");
    }
    uint64_t count = 1;
    bool overflow = false;
    for (const Json& d : *sh) {
      RC_ASSIGN_OR_RETURN(uint64_t dim, GetU64(d, "safetensors tensor '" + name + "'.shape"));
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
      if (dim != 0 && count > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
      if (!overflow) count *= dim;
      e.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(
          dim, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))));
    }
    const uint64_t esize = DTypeSize(e.dtype);
    if (overflow || count > std::numeric_limits<uint64_t>::max() / esize) {
      return InvalidArgument("safetensors tensor '" + name + "': shape overflows 64 bits");
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return InvalidArgument("safetensors tensor '" + name +
                             "'.data_offsets: expected an array of two integers");
    }
    RC_ASSIGN_OR_RETURN(e.begin, GetU64((*off)[0], "safetensors tensor '" + name + "'.data_offsets[0]"));
    RC_ASSIGN_OR_RETURN(e.end, GetU64((*off)[1], "safetensors tensor '" + name + "'.data_offsets[1]"));
    if (e.begin > e.end) {
      return InvalidArgument("safetensors tensor '" + name + "': data_offsets [" + std::to_string(e.begin) + ", " +
                             std::to_string(e.end) + ") end before they begin");
    }
    if (e.end > data_size) {
      return InvalidArgument("safetensors tensor '" + name + "': data_offsets [" +
                             std::to_string(e.begin) + ", " + std::to_string(e.end) +
                             ") outside the " + std::to_string(data_size) + "-byte data section");
    }
    if (e.end - e.begin != count * esize) {
      return InvalidArgument("safetensors tensor '" + name + "': " + std::to_string(count) +
                             " elements of " + std::string(DTypeName(e.dtype)) + " need " +
                             std::to_string(count * esize) + " bytes, data_offsets give " +
                             std::to_string(e.end - e.begin));
    }
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : h.tensors) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  // As the reference implementation requires: the tensors tile the data section, from its first
  // byte to the end of the file, with no gap or trailing bytes (either is a truncated header or a
  // file written wrong).
  uint64_t at = 0;
  for (size_t i = 0; i < by_offset.size(); ++i) {
    if (i > 0 && by_offset[i]->begin < by_offset[i - 1]->end) {
      return InvalidArgument("safetensors: tensors '" + by_offset[i - 1]->name + "' and '" +
                             by_offset[i]->name + "' overlap");
    }
    if (by_offset[i]->begin != at) {
      return InvalidArgument("safetensors: " + std::to_string(by_offset[i]->begin - at) +
                             " bytes of the data section before tensor '" + by_offset[i]->name + "' (offset " +
                             std::to_string(at) + ") belong to no tensor");
    }
    at = by_offset[i]->end;
  }
  if (at != data_size) {
    return InvalidArgument("safetensors: " + std::to_string(data_size - at) + " bytes after the last tensor (offset " +
                           std::to_string(at) + " of a " + std::to_string(data_size) +
                           "-byte data section) belong to no tensor");
  }
  return h;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // Only regular files: opening a FIFO blocks until a writer appears (start-up would hang), and
  // a device has no size to check the header against. Look first, then open without blocking
  // and check again what was opened.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return InvalidArgument("safetensors file '" + path + "' is not a regular file (a FIFO, device, socket or "
                           "directory); refusing to open it");
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return NotFound("cannot open safetensors file '" + path + "'");
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Internal("cannot stat '" + path + "'");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("safetensors file '" + path + "' is not a regular file; refusing to read it");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* base = nullptr;
  if (size > 0) {
    base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) {
      ::close(fd);
      return Internal("cannot mmap '" + path + "'");
    }
  }
  ::close(fd);
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->base_ = static_cast<const uint8_t*>(base);
  f->size_ = size;
  auto h = ParseSafetensorsHeader(std::span<const uint8_t>(f->base_, size), size);
  if (!h.ok()) return h.status().WithContext(path);
  f->header_ = std::move(*h);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

std::span<const uint8_t> SafetensorsFile::Bytes(const TensorEntry& entry) const {
  return {base_ + header_.data_offset + entry.begin, static_cast<size_t>(entry.end - entry.begin)};
}

Result<std::unique_ptr<SafetensorsFolder>> SafetensorsFolder::Open(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return NotFound("model folder '" + dir + "' does not exist");
  }
  std::vector<std::string> paths;
  for (const auto& de : std::filesystem::directory_iterator(dir, ec)) {
    if (de.path().extension() == ".safetensors") paths.push_back(de.path().string());
  }
  std::sort(paths.begin(), paths.end());
  // A sharded checkpoint's index (Transformers' model.safetensors.index.json) names the shards:
  // only those are read (a stray *.safetensors beside them is left out, as vLLM does), each must
  // exist, and every tensor it maps must be in the shard it names.
  const std::string index_path = (std::filesystem::path(dir) / "model.safetensors.index.json").string();
  std::map<std::string, std::string> weight_map;
  std::set<std::string> weight_map_files;
  const bool indexed = std::filesystem::exists(index_path, ec);
  if (indexed) {
    RC_ASSIGN_OR_RETURN(Json index, ReadJsonFile(index_path));
    const Json* map = index.is_object() && index.contains("weight_map") ? &index["weight_map"] : nullptr;
    if (map == nullptr || !map->is_object()) {
      return InvalidArgument(fmt::format("{}: expected an object with a \"weight_map\" object", index_path));
    }
    std::set<std::string>& shards = weight_map_files;
    for (const auto& [tensor, shard] : map->items()) {
      if (!shard.is_string()) return InvalidArgument(fmt::format("{}: weight_map.{}: expected a file name", index_path, tensor));
      const std::string file = shard.get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        return InvalidArgument(
            fmt::format("{}: weight_map.{}: '{}' is not a file name in the folder", index_path, tensor, file));
      }
      weight_map[tensor] = file;
      if (shards.insert(file).second && !std::filesystem::is_regular_file(std::filesystem::path(dir) / file, ec)) {
        return NotFound(
            fmt::format("{} names shard '{}' (tensor '{}'), which is missing from '{}'", index_path, file, tensor, dir));
      }
    }
    if (shards.empty()) return InvalidArgument(fmt::format("{}: weight_map is empty", index_path));
  }
  auto folder = std::make_unique<SafetensorsFolder>();
  folder->dir_ = dir;
  if (indexed) {
    std::vector<std::string> listed;
    for (const auto& p : paths) {
      (weight_map_files.count(std::filesystem::path(p).filename().string()) ? listed : folder->left_out_).push_back(p);
    }
    paths = std::move(listed);
  }
  if (paths.empty()) return NotFound(fmt::format("model folder '{}' has no *.safetensors file", dir));
  for (const auto& p : paths) {
    RC_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(p));
    const size_t idx = folder->files_.size();
    for (const auto& e : f->header().tensors) {
      auto [it, inserted] = folder->index_.emplace(e.name, std::make_pair(idx, &e));
      if (!inserted) {
        return InvalidArgument(fmt::format("tensor '{}' appears in both '{}' and '{}'", e.name,
                                           folder->files_[it->second.first]->path(), p));
      }
    }
    folder->files_.push_back(std::move(f));
  }
  for (const auto& [tensor, file] : weight_map) {
    auto it = folder->index_.find(tensor);
    const std::string holder =
        it == folder->index_.end()
            ? std::string()
            : std::filesystem::path(folder->files_[it->second.first]->path()).filename().string();
    if (holder != file) {
      return InvalidArgument(fmt::format("{} maps tensor '{}' to '{}', but {}", index_path, tensor, file,
                                         holder.empty() ? std::string("no shard holds it")
                                                        : fmt::format("it is in '{}'", holder)));
    }
  }
  return folder;
}

Result<SafetensorsFolder::Located> SafetensorsFolder::Find(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return NotFound("tensor '" + std::string(name) + "' is missing from the safetensors in '" +
                    dir_ + "'");
  }
  Located l;
  l.entry = it->second.second;
  l.bytes = files_[it->second.first]->Bytes(*l.entry);
  return l;
}

std::vector<std::string> SafetensorsFolder::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, v] : index_) out.push_back(n);
  return out;
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> sorted;
  sorted.reserve(tensors.size());
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson m = OrderedJson::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto* t : sorted) {
    uint64_t count = 1;
    for (int64_t d : t->shape) {
      if (d < 0) return InvalidArgument("tensor '" + t->name + "': negative dimension");
      count *= static_cast<uint64_t>(d);
    }
    const uint64_t bytes = count * DTypeSize(t->dtype);
    if (bytes != t->bytes.size()) {
      return InvalidArgument("tensor '" + t->name + "': shape needs " + std::to_string(bytes) +
                             " bytes, got " + std::to_string(t->bytes.size()));
    }
    header[t->name] = {{"dtype", DTypeName(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Internal("cannot create '" + path + "'");
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto* t : sorted) {
    out.write(reinterpret_cast<const char*>(t->bytes.data()),
              static_cast<std::streamsize>(t->bytes.size()));
  }
  out.close();
  if (!out) return Internal("short write to '" + path + "'");
  return OkStatus();
}

float BF16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xffu) - 127 + 15;
  uint32_t mant = u & 0x7fffffu;
  if (((u >> 23) & 0xffu) == 0xffu) return sign | 0x7c00u | (mant ? 0x200u : 0u);
  if (exp >= 31) return sign | 0x7c00u;
  if (exp <= 0) {
    if (exp < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

Status ConvertToF32(DType dtype, const uint8_t* src, size_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return OkStatus();
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = BF16ToF32(h);
      }
      return OkStatus();
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = F16ToF32(h);
      }
      return OkStatus();
    default:
      return InvalidArgument("cannot convert " + std::string(DTypeName(dtype)) +
                             " weights to F32 (supported: F32, F16, BF16)");
  }
}

}  // namespace rc::formats
