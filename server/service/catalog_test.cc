// Catalog: a name is reserved once while it loads (ALREADY_EXISTS for the
// second, also when many threads race), lookups say NOT_FOUND with the
// message clients match, a refused change leaves the catalog and the
// journal untouched, generation waiters wake on installs and unloads,
// stacks resolve to adapters, seqs and guards, and pruning keeps what a
// lease holds.
#include "server/service/catalog.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "server/service/generations.h"

namespace weightd {
namespace {

std::shared_ptr<Model> MakeModel(const std::string& name) {
  auto model = std::make_shared<Model>();
  model->name = name;
  model->instance = 1;
  auto gen = std::make_shared<Generation>();
  gen->number = 1;
  gen->content = std::make_shared<ContentMap>();
  model->current = gen;
  model->history = {gen};
  return model;
}

std::shared_ptr<Generation> NextGeneration(uint64_t number) {
  auto gen = std::make_shared<Generation>();
  gen->number = number;
  gen->content = std::make_shared<ContentMap>();
  return gen;
}

// Loads `name` as the model service does: reserve, then publish in a change.
void Load(Catalog& catalog, const std::string& name) {
  ASSERT_TRUE(catalog.ReserveLoad(name, std::make_shared<Cancellation>()).ok());
  StateRecord record;
  ASSERT_TRUE(catalog
                  .Commit(
                      record, [] { return absl::OkStatus(); },
                      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
                        catalog.PublishLoadedLocked(name, MakeModel(name));
                      })
                  .ok());
}

void Install(Catalog& catalog, const std::string& name, uint64_t number) {
  StateRecord record;
  std::vector<uint64_t> retired;
  ASSERT_TRUE(catalog
                  .Commit(
                      record, [] { return absl::OkStatus(); },
                      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
                        catalog.InstallGenerationLocked(name, NextGeneration(number), &retired);
                      })
                  .ok());
}

TEST(CatalogTest, ANameIsReservedOnceWhileItLoadsAndWhenLoaded) {
  Catalog catalog(nullptr);
  ASSERT_TRUE(catalog.ReserveLoad("m", std::make_shared<Cancellation>()).ok());
  absl::Status again = catalog.ReserveLoad("m", std::make_shared<Cancellation>());
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(again.message(), "model \"m\" is already loaded");
  // Not visible while it loads.
  EXPECT_EQ(catalog.FindModel("m").status().code(), absl::StatusCode::kNotFound);
  catalog.CancelLoad("m");  // the load failed: the name is free again
  Load(catalog, "m");
  EXPECT_EQ(catalog.ReserveLoad("m", std::make_shared<Cancellation>()).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(catalog.FindModel("m").ok());
  EXPECT_EQ((*catalog.FindModel("m"))->name, "m");
}

TEST(CatalogTest, CancellingALoadCancelsItAndWaitsForItsEnd) {
  Catalog catalog(nullptr);
  EXPECT_FALSE(*catalog.CancelLoading("m", "unloaded", absl::Seconds(1)));  // none running
  auto cancel = std::make_shared<Cancellation>();
  ASSERT_TRUE(catalog.ReserveLoad("m", cancel).ok());
  std::atomic<bool> gave_back{false};
  // The load: sees its cancellation between two reads, frees what it had,
  // then gives its name back.
  std::thread load([&] {
    while (!cancel->cancelled()) absl::SleepFor(absl::Milliseconds(1));
    absl::SleepFor(absl::Milliseconds(50));
    gave_back = true;
    catalog.CancelLoad("m");
  });
  absl::StatusOr<bool> cancelled = catalog.CancelLoading("m", "unloaded", absl::Seconds(30));
  EXPECT_TRUE(gave_back.load());  // returned only after the load ended
  load.join();
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_TRUE(*cancelled);
  EXPECT_EQ(cancel->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cancel->status().message(), "cancelled: unloaded");
  EXPECT_TRUE(catalog.ReserveLoad("m", std::make_shared<Cancellation>()).ok());
}

TEST(CatalogTest, ALoadThatDoesNotEndInTimeIsDeadlineExceeded) {
  Catalog catalog(nullptr);
  auto cancel = std::make_shared<Cancellation>();
  ASSERT_TRUE(catalog.ReserveLoad("m", cancel).ok());
  absl::StatusOr<bool> r = catalog.CancelLoading("m", "unloaded", absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(cancel->cancelled());
  // A second cancel keeps the first reason.
  EXPECT_FALSE(cancel->Cancel("other"));
  EXPECT_EQ(cancel->status().message(), "cancelled: unloaded");
  catalog.CancelLoad("m");
}

TEST(CatalogTest, OneOfManyRacingReservationsWins) {
  Catalog catalog(nullptr);
  std::atomic<int> won{0}, refused{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      absl::Status s = catalog.ReserveLoad("m", std::make_shared<Cancellation>());
      if (s.ok()) {
        ++won;
      } else if (s.code() == absl::StatusCode::kAlreadyExists) {
        ++refused;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_EQ(refused.load(), 7);
}

TEST(CatalogTest, UnknownNamesAreNotFoundWithTheMessageClientsSee) {
  Catalog catalog(nullptr);
  absl::Status s = catalog.FindModel("nope").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "model \"nope\" is not loaded");
  Load(catalog, "m");
  s = catalog.ResolveStack("m", {AdapterRef{"lora", 1.0f}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "adapter \"lora\" is not loaded");
}

TEST(CatalogTest, ARefusedChangeIsNotJournaledAndChangesNothing) {
  std::vector<uint64_t> journaled;
  Catalog catalog([&](const StateRecord& r) { journaled.push_back(r.seq); });
  Load(catalog, "m");
  ASSERT_EQ(journaled, std::vector<uint64_t>{1});
  StateRecord record;
  bool published = false;
  absl::Status s = catalog.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        return catalog.ModelLocked("m") != nullptr ? absl::AbortedError("lost the race")
                                                   : absl::OkStatus();
      },
      [&] { published = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(published);
  EXPECT_EQ(journaled, std::vector<uint64_t>{1});
}

TEST(CatalogTest, WaitersWakeOnANewGenerationAndOnUnload) {
  Catalog catalog(nullptr);
  Load(catalog, "m");
  // Nothing newer: the wait times out.
  auto none = catalog.WaitForGeneration("m", 1, absl::Milliseconds(1));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // Already newer: no wait.
  auto now = catalog.WaitForGeneration("m", 0, absl::ZeroDuration());
  ASSERT_TRUE(now.ok() && now->has_value());
  EXPECT_EQ((*now)->generation, 1u);

  absl::StatusOr<std::optional<GenerationInfo>> woken;
  std::thread waiter([&] { woken = catalog.WaitForGeneration("m", 1, absl::Hours(1)); });
  Install(catalog, "m", 2);
  waiter.join();
  ASSERT_TRUE(woken.ok() && woken->has_value());
  EXPECT_EQ((*woken)->generation, 2u);
  EXPECT_EQ((*woken)->model, "m");

  std::thread gone([&] { woken = catalog.WaitForGeneration("m", 2, absl::Hours(1)); });
  StateRecord record;
  std::shared_ptr<const Model> dropped;
  ASSERT_TRUE(catalog
                  .Commit(
                      record, [] { return absl::OkStatus(); },
                      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
                        dropped = catalog.EraseModelLocked("m");
                      })
                  .ok());
  gone.join();
  EXPECT_EQ(woken.status().code(), absl::StatusCode::kNotFound);
  ASSERT_NE(dropped, nullptr);
  EXPECT_EQ(dropped->name, "m");
  EXPECT_TRUE(catalog.Models().empty());
}

TEST(CatalogTest, AStackResolvesToItsAdaptersSeqsAndPrivateGuardsOnce) {
  Catalog catalog(nullptr);
  Load(catalog, "m");
  auto readers = ReaderList::Parse({"uid:1234"});
  ASSERT_TRUE(readers.ok());
  StateRecord record;
  ASSERT_TRUE(catalog
                  .Commit(
                      record, [] { return absl::OkStatus(); },
                      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
                        AdapterSummary pub{.name = "pub"};
                        AdapterSummary priv{.name = "priv"};
                        catalog.AddAdapterLocked("pub", std::make_shared<Adapter>(), 7, pub,
                                                 ReaderList());
                        catalog.AddAdapterLocked("priv", std::make_shared<Adapter>(), 9, priv,
                                                 *readers);
                      })
                  .ok());
  EXPECT_EQ(catalog.AdapterCount(), 2u);
  std::vector<AdapterSummary> listed = catalog.ListAdapters();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].name, "priv");  // by name
  auto stack = catalog.ResolveStack(
      "m", {AdapterRef{"priv", 1.0f}, AdapterRef{"pub", 0.5f}, AdapterRef{"priv", 2.0f}});
  ASSERT_TRUE(stack.ok()) << stack.status();
  EXPECT_EQ(stack->model->name, "m");
  EXPECT_EQ(stack->adapters.size(), 3u);
  EXPECT_EQ(stack->seqs, (std::vector<uint64_t>{9, 7, 9}));
  ASSERT_EQ(stack->guards.size(), 1u);
  EXPECT_EQ(stack->guards[0].what, "adapter \"priv\"");
}

TEST(CatalogTest, PruningKeepsTheCurrentAndTheLeasedGenerations) {
  Catalog catalog(nullptr);
  Load(catalog, "m");
  std::shared_ptr<const Generation> first = (*catalog.FindModel("m"))->current;
  std::shared_ptr<const int> lease = first->lease_marker;  // generation 1 is leased
  Install(catalog, "m", 2);
  Install(catalog, "m", 3);  // 2 was never leased: retired at once
  first.reset();
  EXPECT_EQ((*catalog.FindModel("m"))->history.size(), 2u);  // 1 (leased) and 3
  EXPECT_TRUE(catalog.PruneUnleased().empty());
  lease.reset();
  EXPECT_EQ(catalog.PruneUnleased(), std::vector<std::string>{"m#1"});
  auto model = catalog.FindModel("m");
  ASSERT_EQ((*model)->history.size(), 1u);
  EXPECT_EQ((*model)->history[0]->number, 3u);
}

}  // namespace
}  // namespace weightd
