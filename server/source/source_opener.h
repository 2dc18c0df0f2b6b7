// Remote checkpoints through the load's file seam (common/file_opener.h):
// a FileOpener whose "files" are objects named by URL. The checkpoint
// loader reads them through its usual phases without knowing: Open is a
// HEAD (the object's size and ETag pinned in OpenedFile::st and ::version),
// ReadAt one ranged GET with If-Match straight into the segment, Stat a HEAD
// that fails ABORTED when the ETag or size moved, List an S3 listing. A
// directory is a URL ending in '/' (an S3 prefix); nothing is requested to
// open one. Every URL, the one a load names and every one an index or a
// listing leads to, is confined to the allow-list before any request.
//
// SourceRoutingOpener sends URLs here and paths to the daemon's model roots.
//
// Thread-safe: const, over a thread-safe client.
#ifndef WEIGHTD_SERVER_SOURCE_SOURCE_OPENER_H_
#define WEIGHTD_SERVER_SOURCE_SOURCE_OPENER_H_

#include <string>
#include <vector>

#include "common/file_opener.h"
#include "server/source/source_client.h"
#include "server/source/source_url.h"

namespace weightd {

class RemoteFileOpener final : public FileOpener {
 public:
  // Borrows `client`, which outlives the opener.
  RemoteFileOpener(const SourceClient* client, SourceAllowList allowed)
      : client_(client), allowed_(std::move(allowed)) {}

  // PERMISSION_DENIED for a URL the allow-list does not cover (before any
  // request); else as SourceClient::Head.
  absl::StatusOr<OpenedFile> Open(absl::string_view url) const override;
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override;
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override;
  absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                      void* dest) const override;
  absl::StatusOr<struct stat> Stat(const OpenedFile& file) const override;
  absl::StatusOr<std::vector<std::string>> List(const OpenedFile& dir,
                                                absl::string_view suffix) const override;

  const SourceAllowList& allowed() const { return allowed_; }
  const SourceClient& client() const { return *client_; }

 private:
  absl::StatusOr<OpenedFile> OpenUrl(const SourceUrl& url) const;
  absl::StatusOr<SourceUrl> UrlOf(const OpenedFile& file) const;

  // Constant after construction.
  const SourceClient* const client_;
  const SourceAllowList allowed_;
};

// URLs (LooksLikeUrl) to `remote`, or PERMISSION_DENIED when it is null (no
// sources configured); everything else to `files`. Both borrowed.
class SourceRoutingOpener final : public FileOpener {
 public:
  SourceRoutingOpener(const FileOpener* files, const FileOpener* remote)
      : files_(files), remote_(remote) {}

  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override;
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override {
    return For(dir).OpenIn(dir, name);
  }
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override {
    return For(file).OpenBeside(file, name);
  }
  absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                      void* dest) const override {
    return For(file).ReadAt(file, offset, length, dest);
  }
  absl::StatusOr<struct stat> Stat(const OpenedFile& file) const override {
    return For(file).Stat(file);
  }
  absl::StatusOr<std::vector<std::string>> List(const OpenedFile& dir,
                                                absl::string_view suffix) const override {
    return For(dir).List(dir, suffix);
  }

 private:
  // Only an opened file's own opener made it: a remote one has no fd.
  const FileOpener& For(const OpenedFile& f) const {
    return remote_ != nullptr && !f.fd.valid() && LooksLikeUrl(f.path) ? *remote_ : *files_;
  }

  // Constant after construction.
  const FileOpener* const files_;
  const FileOpener* const remote_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SOURCE_SOURCE_OPENER_H_
