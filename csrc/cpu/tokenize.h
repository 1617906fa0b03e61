// The query side of the lexical channel's tokenizer (rfmem_fast/lexical.py, Analyzer
// without a stemmer, LexicalIndex.encode_queries): ASCII texts lowercased and split at
// their non-word characters (the maximal runs of [a-z0-9_], TOKEN_PATTERN's tokens once
// the 1-character runs are dropped), stopwords dropped, each token looked up in the
// bank's vocabulary (an append-only token -> id table mirrored here).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rfmem {

/// An append-only set of strings, each with its index (0, 1, ... in order of insertion):
/// open addressing over 64-bit hashes, at most half full.
class StringTable {
 public:
  StringTable();
  int64_t size() const { return static_cast<int64_t>(off_.size()); }
  /// Appends p[0:n] with index size(); false (nothing added) when it is already there.
  bool add(const char* p, size_t n);
  /// The index of p[0:n], -1 when absent.
  int32_t find(const char* p, size_t n) const { return find(p, n, hash_of(p, n)); }
  /// The same with its hash h = hash_of(p, n) computed before (prefetch(h) in between).
  int32_t find(const char* p, size_t n, uint64_t h) const;
  /// The slot where a string of hash h is looked up first, on its way from memory.
  void prefetch(uint64_t h) const { __builtin_prefetch(&slots_[h & (slots_.size() - 1)]); }
  static uint64_t hash_of(const char* p, size_t n);

 private:
  struct Slot {
    uint64_t hash;
    int32_t id;  // -1: empty
  };
  size_t slot_of(const char* p, size_t n, uint64_t h) const;  // its slot, or the empty one it would take
  void grow();

  std::string blob_;            // the strings' bytes, one after the other
  std::vector<uint64_t> off_;   // index -> offset in blob_
  std::vector<uint32_t> len_;   // index -> length
  std::vector<Slot> slots_;     // power-of-two table
};

/// The bank's vocabulary (token -> int32 id, ids in order of insertion: Vocabulary.tokens)
/// and the stopwords the encoder drops.
class TokenIds {
 public:
  explicit TokenIds(const std::vector<std::string>& stopwords);
  int64_t size() const { return vocab_.size(); }
  /// Appends a token with id size(); false when it is already there (then nothing is added).
  bool add(const std::string& token) { return vocab_.add(token.data(), token.size()); }
  /// Encodes b ASCII texts (texts[i], lens[i]; a null pointer: no token) as
  /// LexicalIndex.encode_queries: per text its distinct known token ids in order of first
  /// occurrence (terms) and how often each occurs (cnt), CSR with ptr [b + 1].
  void encode(const std::vector<const char*>& texts, const std::vector<size_t>& lens, std::vector<int32_t>& terms,
              std::vector<double>& cnt, std::vector<int64_t>& ptr) const;

 private:
  StringTable vocab_;
  StringTable stop_;
};

}  // namespace rfmem
