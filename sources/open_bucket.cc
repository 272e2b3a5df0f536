#include "sources/open_bucket.h"

#include "core/manifest.h"

namespace weightfs {

std::string TrlModelNameFromUrl(std::string_view url) {
  if (size_t q = url.find_first_of("?#"); q != std::string_view::npos) url = url.substr(0, q);
  if (size_t scheme = url.find("://"); scheme != std::string_view::npos) url = url.substr(scheme + 3);
  while (!url.empty() && url.back() == '/') url.remove_suffix(1);
  std::string_view last = url.substr(url.rfind('/') == std::string_view::npos ? 0 : url.rfind('/') + 1);
  std::string out;
  for (char c : last.substr(0, 128)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    out += ok ? c : '-';
  }
  if (!ValidateModelName(out).ok()) return "trl";
  return out;
}

Expected<std::unique_ptr<Bucket>> OpenBucketAnyLayout(std::shared_ptr<Store> store, std::string_view url,
                                                      std::string_view trl_model,
                                                      const TrlOptions& trl_options) {
  Expected<std::unique_ptr<Bucket>> bucket = Bucket::Open(store);
  if (bucket.ok() || bucket.status().kind() != ErrorKind::kNotFound) return bucket;
  const std::string model = trl_model.empty() ? TrlModelNameFromUrl(url) : std::string(trl_model);
  Expected<std::shared_ptr<TrlVersions>> trl = OpenTrlVersions(store, model, trl_options);
  if (!trl.ok()) {
    if (trl.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound(bucket.status().message() + " to make it a weightfs bucket (it is not a TRL "
                              "delta-sync bucket either: no anchors/step_NNNNNN.safetensors or "
                              "deltas/step_NNNNNN.safetensors)");
    }
    return trl.status().WithContext("reading " + store->Describe() + " as a TRL delta-sync bucket");
  }
  return Bucket::FromDerived(std::move(store), std::move(trl).value());
}

}  // namespace weightfs
