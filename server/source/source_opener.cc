#include "server/source/source_opener.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"

namespace weightd {

absl::StatusOr<OpenedFile> RemoteFileOpener::OpenUrl(const SourceUrl& url) const {
  OpenedFile f;
  f.path = url.normalized;
  f.beneath = url.normalized;
  f.st.st_nlink = 1;
  if (url.is_directory()) {
    f.st.st_mode = S_IFDIR | 0555;
    return f;
  }
  WD_ASSIGN_OR_RETURN(ObjectInfo info, client_->Head(url));
  f.st.st_mode = S_IFREG | 0444;
  f.st.st_size = static_cast<off_t>(info.size);
  // The version pinned for every range and checked again after reading;
  // without an ETag, the Last-Modified header and the size stand in (and
  // ranges go without If-Match).
  f.version = !info.etag.empty() ? info.etag
                                 : absl::StrCat("last-modified:", info.last_modified);
  return f;
}

absl::StatusOr<SourceUrl> RemoteFileOpener::UrlOf(const OpenedFile& file) const {
  // The path is the normal form this opener made, inside the allow-list;
  // checked again all the same (a FileOpener takes any OpenedFile).
  return allowed_.Check(file.path);
}

absl::StatusOr<OpenedFile> RemoteFileOpener::Open(absl::string_view url) const {
  WD_ASSIGN_OR_RETURN(SourceUrl parsed, allowed_.Check(url));
  return OpenUrl(parsed);
}

absl::StatusOr<OpenedFile> RemoteFileOpener::OpenIn(const OpenedFile& dir,
                                                    absl::string_view name) const {
  WD_ASSIGN_OR_RETURN(SourceUrl base, UrlOf(dir));
  if (!base.is_directory()) {
    return absl::InvalidArgumentError(absl::StrCat(QuoteForMessage(dir.path),
                                                   " is not a directory"));
  }
  return OpenBeside(dir, name);
}

absl::StatusOr<OpenedFile> RemoteFileOpener::OpenBeside(const OpenedFile& file,
                                                        absl::string_view name) const {
  WD_ASSIGN_OR_RETURN(SourceUrl base, UrlOf(file));
  auto joined = ResolveSourceName(base, name);
  if (!joined.ok()) return Annotate(joined.status(), QuoteForMessage(file.path));
  if (!allowed_.Covers(*joined)) return allowed_.Check(joined->normalized).status();
  return OpenUrl(*joined);
}

absl::Status RemoteFileOpener::ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                                      void* dest) const {
  WD_ASSIGN_OR_RETURN(SourceUrl url, UrlOf(file));
  ObjectInfo pinned;
  pinned.size = static_cast<uint64_t>(file.st.st_size);
  if (!absl::StartsWith(file.version, "last-modified:")) pinned.etag = file.version;
  return client_->ReadRange(url, pinned, offset, length, dest, file.cancel);
}

absl::StatusOr<struct stat> RemoteFileOpener::Stat(const OpenedFile& file) const {
  if (file.is_directory()) return file.st;
  WD_ASSIGN_OR_RETURN(SourceUrl url, UrlOf(file));
  WD_ASSIGN_OR_RETURN(OpenedFile now, OpenUrl(url));
  if (now.version != file.version || now.st.st_size != file.st.st_size) {
    return absl::AbortedError(absl::StrCat(
        "object ", QuoteForMessage(file.path), " changed while loading (ETag ", file.version,
        " -> ", now.version, ", size ", file.st.st_size, " -> ", now.st.st_size, ")"));
  }
  return file.st;
}

absl::StatusOr<std::vector<std::string>> RemoteFileOpener::List(const OpenedFile& dir,
                                                                absl::string_view suffix) const {
  WD_ASSIGN_OR_RETURN(SourceUrl url, UrlOf(dir));
  return client_->List(url, suffix);
}

absl::StatusOr<OpenedFile> SourceRoutingOpener::Open(absl::string_view path) const {
  if (!LooksLikeUrl(path)) return files_->Open(path);
  if (remote_ == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat(
        "url ", UrlForMessage(path), " is outside the model sources [] (no --model-source)"));
  }
  return remote_->Open(path);
}

}  // namespace weightd
