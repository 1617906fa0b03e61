// The query tokenizer of the lexical channel (tokenize.h).
#include "tokenize.h"

#include <cstring>

namespace rfmem {

namespace {

// ASCII byte -> its byte in a token ([a-z0-9_] themselves, [A-Z] lowercased), 0 for a
// separator (every other byte): lexical.py's _ASCII_WORDS.
struct WordBytes {
  unsigned char map[256];
  WordBytes() {
    for (int c = 0; c < 256; ++c) {
      const bool word = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
      map[c] = static_cast<unsigned char>(c >= 'A' && c <= 'Z' ? c + 32 : word ? c : 0);
    }
  }
};
const WordBytes kWord;

}  // namespace

StringTable::StringTable() : slots_(64, Slot{0, -1}) {}

uint64_t StringTable::hash_of(const char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ n;  // FNV-1a, then a final mix
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 33);
}

size_t StringTable::slot_of(const char* p, size_t n, uint64_t h) const {
  const size_t mask = slots_.size() - 1;
  for (size_t s = h & mask;; s = (s + 1) & mask) {
    const Slot& sl = slots_[s];
    if (sl.id < 0) return s;
    if (sl.hash == h && len_[sl.id] == n && std::memcmp(blob_.data() + off_[sl.id], p, n) == 0) return s;
  }
}

void StringTable::grow() {
  std::vector<Slot> old(slots_.size() * 2, Slot{0, -1});
  old.swap(slots_);
  const size_t mask = slots_.size() - 1;
  for (const Slot& sl : old) {
    if (sl.id < 0) continue;
    size_t s = sl.hash & mask;
    while (slots_[s].id >= 0) s = (s + 1) & mask;
    slots_[s] = sl;
  }
}

bool StringTable::add(const char* p, size_t n) {
  const uint64_t h = hash_of(p, n);
  const size_t s = slot_of(p, n, h);
  if (slots_[s].id >= 0) return false;
  const int32_t id = static_cast<int32_t>(off_.size());
  off_.push_back(blob_.size());
  len_.push_back(static_cast<uint32_t>(n));
  blob_.append(p, n);
  slots_[s] = Slot{h, id};
  if (2 * off_.size() > slots_.size()) grow();
  return true;
}

int32_t StringTable::find(const char* p, size_t n, uint64_t h) const { return slots_[slot_of(p, n, h)].id; }

TokenIds::TokenIds(const std::vector<std::string>& stopwords) {
  for (const std::string& w : stopwords) stop_.add(w.data(), w.size());
}

void TokenIds::encode(const std::vector<const char*>& texts, const std::vector<size_t>& lens,
                      std::vector<int32_t>& terms, std::vector<double>& cnt, std::vector<int64_t>& ptr) const {
  const size_t b = texts.size();
  ptr.assign(b + 1, 0);
  terms.clear();
  cnt.clear();
  // per text: its tokens (lowered into buf: start, length, hash), their vocabulary slots
  // prefetched, then looked up (a batch after a scan finds the table cold: the slots'
  // misses overlap instead of one after another)
  std::string buf;
  struct Tok {
    size_t at, len;
    uint64_t hash;
  };
  std::vector<Tok> toks;
  for (size_t i = 0; i < b; ++i) {
    const size_t first = terms.size();  // this text's distinct ids: terms[first:]
    const char* p = texts[i];
    const size_t n = p == nullptr ? 0 : lens[i];
    buf.clear();
    toks.clear();
    for (size_t j = 0; j < n;) {
      while (j < n && kWord.map[static_cast<unsigned char>(p[j])] == 0) ++j;
      const size_t at = buf.size();
      for (; j < n; ++j) {
        const unsigned char c = kWord.map[static_cast<unsigned char>(p[j])];
        if (c == 0) break;
        buf.push_back(static_cast<char>(c));
      }
      const size_t len = buf.size() - at;
      if (len < 2 || stop_.find(buf.data() + at, len) >= 0) {  // (1-character runs, stopwords)
        buf.resize(at);
        continue;
      }
      const uint64_t h = StringTable::hash_of(buf.data() + at, len);
      vocab_.prefetch(h);
      toks.push_back(Tok{at, len, h});
    }
    for (const Tok& t : toks) {
      const int32_t id = vocab_.find(buf.data() + t.at, t.len, t.hash);
      if (id < 0) continue;
      size_t k = first;
      while (k < terms.size() && terms[k] != id) ++k;
      if (k == terms.size()) {
        terms.push_back(id);
        cnt.push_back(1.0);
      } else {
        cnt[k] += 1.0;
      }
    }
    ptr[i + 1] = static_cast<int64_t>(terms.size());
  }
}

}  // namespace rfmem
