// A client of a c10d TCPStore: under torchrun, the launcher's agent already serves one on
// MASTER_ADDR:MASTER_PORT, and the ranks meet through it instead of binding ports of their own.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "protect.h"
#include "shim.h"

using mrs_detail::protect;

struct mrs_store {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

extern "C" {

char* mrs_tcp_store_connect(const char* host, uint16_t port, int64_t timeout_ms,
                            mrs_store** store_out) {
  return protect([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = false;
    options.waitWorkers = false;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    *store_out = new mrs_store{c10::make_intrusive<c10d::TCPStore>(std::string(host), options)};
  });
}

char* mrs_tcp_store_set(mrs_store* store, const char* key, const uint8_t* value, size_t length) {
  return protect([&] {
    store->store->set(std::string(key), std::vector<uint8_t>(value, value + length));
  });
}

char* mrs_tcp_store_get(mrs_store* store, const char* key, uint8_t** value_out,
                        size_t* length_out) {
  return protect([&] {
    auto value = store->store->get(std::string(key));
    auto* bytes = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
    std::memcpy(bytes, value.data(), value.size());
    *value_out = bytes;
    *length_out = value.size();
  });
}

void mrs_tcp_store_free(mrs_store* store) { delete store; }

}  // extern "C"
