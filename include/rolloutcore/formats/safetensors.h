// Safetensors: reader, writer and a hardened header parser for the Hugging Face format.
//
// File layout: 8-byte little-endian header length N, N bytes of JSON mapping tensor name to
// {dtype, shape, data_offsets:[begin,end]} (offsets relative to the byte after the header),
// optional "__metadata__" (string -> string), then the data. ParseSafetensorsHeader treats the
// bytes as hostile: it bounds N, never throws, and checks every entry (known dtype,
// non-negative shape, element count * element size == end - begin without overflow,
// begin <= end <= data size, no overlapping ranges, unique non-empty names).
//
// Thread safety: ParseSafetensorsHeader and the converters are pure. A SafetensorsFile is
// immutable after Open (read-only mmap) and may be read from any thread.
//
// Module `formats` (docs/architecture.md): depends on base only. The engine's loader reads HF
// checkpoints through it and the trainer's HF export writes them, without either depending on
// the other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::formats {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32", "BF16", ... as spelled in safetensors headers.
std::string_view DTypeName(DType dtype);
Result<DType> DTypeFromName(std::string_view name);
size_t DTypeSize(DType dtype);

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
  int64_t NumElements() const;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // absolute offset of the data section (8 + N)
  const TensorEntry* Find(std::string_view name) const;
};

// Upper bound on the JSON header (the reference implementation uses 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// Parses the header from the first bytes of a file whose total size is file_size. `prefix`
// must hold at least 8 + N bytes (fewer: InvalidArgument saying how many are needed).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix,
                                                 uint64_t file_size);

// A read-only memory-mapped safetensors file.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The tensor's raw bytes (validated against the file size by the parser).
  std::span<const uint8_t> Bytes(const TensorEntry& entry) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// All *.safetensors files of a folder, as one name space (a name in two files is an error). With
// a model.safetensors.index.json, only the shards its weight_map names: each must exist and hold
// the tensors mapped to it (errors name the index, the shard and the tensor).
class SafetensorsFolder {
 public:
  static Result<std::unique_ptr<SafetensorsFolder>> Open(const std::string& dir);
  struct Located {
    const TensorEntry* entry = nullptr;
    std::span<const uint8_t> bytes;
  };
  // NotFound naming the tensor and the folder.
  Result<Located> Find(std::string_view name) const;
  std::vector<std::string> Names() const;
  const std::string& dir() const { return dir_; }
  // With a model.safetensors.index.json: the *.safetensors files of the folder it does not name
  // (not read).
  const std::vector<std::string>& left_out() const { return left_out_; }

 private:
  std::string dir_;
  std::vector<std::string> left_out_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<size_t, const TensorEntry*>, std::less<>> index_;
};

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // must be NumElements * DTypeSize long
};

// Writes a safetensors file (tensors sorted by name, 8-byte aligned header).
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// Converts n elements of src (F32, F16 or BF16) to f32. InvalidArgument for other dtypes.
Status ConvertToF32(DType dtype, const uint8_t* src, size_t n, float* dst);
// f32 -> bf16 with round-to-nearest-even (NaN stays NaN).
uint16_t F32ToBF16(float f);
float BF16ToF32(uint16_t h);
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

}  // namespace rc::formats
