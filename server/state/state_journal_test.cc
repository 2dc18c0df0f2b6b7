#include "server/state/state_journal.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace weightd {
namespace {

StateRecord Rec(StateRecord::Kind kind, uint64_t seq, std::string name) {
  StateRecord r;
  r.kind = kind;
  r.seq = seq;
  r.name = std::move(name);
  return r;
}

StateRecord ModelLoad(uint64_t seq, std::string name) {
  StateRecord r = Rec(StateRecord::Kind::kModelLoad, seq, std::move(name));
  r.path = "/models/" + r.name + ".safetensors";
  r.profile_json = R"({"version": 1})";
  r.readers = {"uid:1000"};
  r.generation = 1;
  r.content = "00112233445566778899aabbccddeeff";
  return r;
}

StateRecord AdapterLoad(uint64_t seq, std::string name, std::string path) {
  StateRecord r = Rec(StateRecord::Kind::kAdapterLoad, seq, std::move(name));
  r.path = std::move(path);
  r.format = "peft";
  r.strict = true;
  return r;
}

StateRecord Apply(uint64_t seq, std::string model, uint64_t gen,
                  std::vector<std::pair<std::string, float>> stack) {
  StateRecord r = Rec(StateRecord::Kind::kApply, seq, std::move(model));
  r.generation = gen;
  r.stack = std::move(stack);
  r.content = "ffeeddccbbaa99887766554433221100";
  return r;
}

TEST(StateJournalTest, RecordsRoundTripWithEveryField) {
  std::string bytes;
  std::vector<StateRecord> in = {ModelLoad(1, "m"), AdapterLoad(2, "a", "/ad/a"),
                                 Apply(3, "m", 2, {{"a", 0.25f}, {"b", -1.0f}}),
                                 Rec(StateRecord::Kind::kAdapterUnload, 4, "a"),
                                 Rec(StateRecord::Kind::kModelUnload, 5, "m")};
  for (const auto& r : in) bytes += EncodeStateRecord(r);
  JournalContents out = ParseJournal(bytes);
  ASSERT_TRUE(out.problems.empty());
  ASSERT_EQ(out.records.size(), in.size());
  EXPECT_EQ(out.records[0].profile_json, in[0].profile_json);
  EXPECT_EQ(out.records[0].readers, in[0].readers);
  EXPECT_EQ(out.records[0].content, in[0].content);
  EXPECT_EQ(out.records[1].format, "peft");
  EXPECT_TRUE(out.records[1].strict);
  EXPECT_EQ(out.records[2].stack, in[2].stack);
  EXPECT_EQ(out.records[2].generation, 2u);
  EXPECT_EQ(out.records[4].kind, StateRecord::Kind::kModelUnload);
}

TEST(StateJournalTest, EveryTruncationKeepsTheWholeRecordsBeforeIt) {
  std::vector<size_t> ends;
  std::string bytes;
  for (uint64_t i = 1; i <= 4; ++i) {
    bytes += EncodeStateRecord(ModelLoad(i, "m" + std::to_string(i)));
    ends.push_back(bytes.size());
  }
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    JournalContents out = ParseJournal(bytes.substr(0, cut));
    size_t whole = 0;
    while (whole < ends.size() && ends[whole] <= cut) ++whole;
    ASSERT_EQ(out.records.size(), whole) << "cut at " << cut;
    const bool at_boundary = cut == 0 || (whole > 0 && ends[whole - 1] == cut);
    EXPECT_EQ(out.problems.size(), at_boundary ? 0u : 1u) << "cut at " << cut;
  }
}

TEST(StateJournalTest, AFlippedByteLosesOnlyItsRecordAndNamesIt) {
  std::string a = EncodeStateRecord(ModelLoad(1, "first"));
  std::string b = EncodeStateRecord(AdapterLoad(2, "second", "/ad/second"));
  std::string c = EncodeStateRecord(ModelLoad(3, "third"));
  for (size_t i = 0; i < b.size(); ++i) {
    std::string bad = b;
    bad[i] ^= 0x01;
    JournalContents out = ParseJournal(a + bad + c);
    ASSERT_EQ(out.records.size(), 2u) << "byte " << i;
    EXPECT_EQ(out.records[0].name, "first");
    EXPECT_EQ(out.records[1].name, "third");
    ASSERT_EQ(out.problems.size(), 1u) << "byte " << i;
    EXPECT_EQ(out.problems[0].offset, a.size()) << "byte " << i;
  }
  // A flip inside the path: the record still reads, and is named.
  std::string bad = b;
  bad[bad.find("/ad/") + 1] ^= 0x20;
  JournalContents out = ParseJournal(a + bad + c);
  ASSERT_EQ(out.problems.size(), 1u);
  EXPECT_NE(out.problems[0].what.find("adapter load \"second\" (seq 2)"), std::string::npos)
      << out.problems[0].what;
}

TEST(StateJournalTest, PlanFollowsLoadsUnloadsAndAppliesInSeqOrder) {
  // Written out of seq order (two appends raced): the plan follows seq.
  std::vector<StateRecord> records = {
      ModelLoad(1, "m"), AdapterLoad(2, "a", "/ad/a-v1"), Apply(4, "m", 2, {{"a", 1.0f}}),
      Apply(3, "m", 3, {}),  // an older apply written late: seq says it came first
      Rec(StateRecord::Kind::kAdapterUnload, 5, "a"), AdapterLoad(6, "a", "/ad/a-v2"),
      ModelLoad(7, "gone"), Rec(StateRecord::Kind::kModelUnload, 8, "gone"),
      ModelLoad(9, "n")};
  StateRecord floor = Rec(StateRecord::Kind::kFloor, 10, "n");
  floor.generation = 6;
  records.push_back(floor);
  RestorePlan plan = PlanRestore(records);
  ASSERT_EQ(plan.models.size(), 2u);
  EXPECT_EQ(plan.models[0].load.name, "m");
  ASSERT_TRUE(plan.models[0].has_apply);
  EXPECT_EQ(plan.models[0].apply.seq, 4u);
  EXPECT_EQ(plan.models[0].max_generation, 3u);
  // m's stack needs "a" as it was when applied, not as it is now.
  ASSERT_EQ(plan.models[0].stack_adapters.size(), 1u);
  EXPECT_EQ(plan.models[0].stack_adapters[0].path, "/ad/a-v1");
  EXPECT_EQ(plan.models[1].load.name, "n");
  EXPECT_FALSE(plan.models[1].has_apply);
  EXPECT_EQ(plan.models[1].max_generation, 5u);
  ASSERT_EQ(plan.adapters.size(), 1u);
  EXPECT_EQ(plan.adapters[0].path, "/ad/a-v2");
}

TEST(StateJournalTest, APublishIsPlannedWithItsGenerationAndRoundTrips) {
  StateRecord pub = Rec(StateRecord::Kind::kPublish, 3, "m");
  pub.generation = 4;
  pub.content = "0123456789abcdef0123456789abcdef";
  pub.path = "/state/published/x-4.safetensors";
  pub.stack = {{"a", 1.0f}};
  pub.stack_seqs = {2};
  JournalContents parsed = ParseJournal(EncodeStateRecord(pub));
  ASSERT_EQ(parsed.records.size(), 1u);
  EXPECT_EQ(parsed.records[0].kind, StateRecord::Kind::kPublish);
  EXPECT_EQ(parsed.records[0].generation, 4u);
  EXPECT_EQ(parsed.records[0].path, pub.path);
  ASSERT_EQ(parsed.records[0].stack.size(), 1u);
  EXPECT_EQ(parsed.records[0].stack_seqs, std::vector<uint64_t>{2});
  EXPECT_EQ(DescribeRecord(parsed.records[0]), "publish \"m\" (seq 3)");
  StateRecord pub2 = pub;
  pub2.seq = 7;
  pub2.generation = 6;
  pub2.stack.clear();
  pub2.stack_seqs.clear();
  RestorePlan plan = PlanRestore({ModelLoad(1, "m"), AdapterLoad(2, "a", "/ad/a"), pub,
                                  Apply(5, "m", 5, {})});
  // The adapter load a publish's stack merged is found like an apply's.
  ASSERT_EQ(plan.models.size(), 1u);
  EXPECT_EQ(plan.models[0].publish.path, pub.path);
  ASSERT_EQ(plan.models[0].publish_stack_adapters.size(), 1u);
  EXPECT_EQ(plan.models[0].publish_stack_adapters[0].path, "/ad/a");
  plan = PlanRestore({ModelLoad(1, "m"), Apply(2, "m", 2, {{"a", 1.0f}}), pub,
                      Apply(5, "m", 5, {}), ModelLoad(6, "n"), pub2});
  ASSERT_EQ(plan.models.size(), 2u);
  EXPECT_EQ(plan.models[0].publish.seq, 7u);  // the last one
  EXPECT_EQ(plan.models[0].first_publish_seq, 3u);
  EXPECT_EQ(plan.models[0].max_generation, 6u);
  EXPECT_EQ(plan.models[0].apply.seq, 5u);  // after a publish: restore.cc skips it
  EXPECT_EQ(plan.models[1].publish.seq, 0u);
  // A load after the publish starts afresh.
  plan = PlanRestore({ModelLoad(1, "m"), pub, Rec(StateRecord::Kind::kModelUnload, 4, "m"),
                      ModelLoad(5, "m")});
  ASSERT_EQ(plan.models.size(), 1u);
  EXPECT_EQ(plan.models[0].publish.seq, 0u);
  EXPECT_EQ(plan.models[0].max_generation, 1u);
}

TEST(StateJournalTest, AnApplyNamesTheAdapterLoadItMerged) {
  // The apply looked its adapter up (load seq 2); the adapter was unloaded
  // and loaded again from another file (seqs 3, 4) before the apply was
  // published (seq 5): the plan re-applies the file it merged.
  StateRecord apply = Apply(5, "m", 2, {{"a", 1.0f}});
  apply.stack_seqs = {2};
  std::string bytes;
  for (const auto& r : {ModelLoad(1, "m"), AdapterLoad(2, "a", "/ad/v1"),
                        Rec(StateRecord::Kind::kAdapterUnload, 3, "a"),
                        AdapterLoad(4, "a", "/ad/v2"), apply}) {
    bytes += EncodeStateRecord(r);
  }
  JournalContents read = ParseJournal(bytes);
  ASSERT_TRUE(read.problems.empty());
  EXPECT_EQ(read.records[4].stack_seqs, std::vector<uint64_t>{2});
  RestorePlan plan = PlanRestore(read.records);
  ASSERT_EQ(plan.models.size(), 1u);
  ASSERT_EQ(plan.models[0].stack_adapters.size(), 1u);
  EXPECT_EQ(plan.models[0].stack_adapters[0].path, "/ad/v1");
  ASSERT_EQ(plan.adapters.size(), 1u);
  EXPECT_EQ(plan.adapters[0].path, "/ad/v2");
  // A seq that names no intact load of that adapter: no record (reported).
  apply.stack_seqs = {3};
  plan = PlanRestore({ModelLoad(1, "m"), AdapterLoad(2, "a", "/ad/v1"),
                      Rec(StateRecord::Kind::kAdapterUnload, 3, "a"), apply});
  EXPECT_TRUE(plan.models[0].stack_adapters[0].name.empty());
}

// A forged journal: a floor or generation no model can have (near 2^64)
// would make the model's next numbers wrap below ones it had. Such a
// record is damage: reported with its name, not replayed.
TEST(StateJournalTest, AGenerationPastTheLargestIsDamageNamingItsRecord) {
  StateRecord floor = Rec(StateRecord::Kind::kFloor, 3, "m");
  floor.generation = ~uint64_t{0} - 1;
  StateRecord apply = Apply(4, "m", kMaxGeneration + 1, {});
  StateRecord publish = Rec(StateRecord::Kind::kPublish, 5, "m");
  publish.generation = uint64_t{1} << 63;
  StateRecord last_floor = Rec(StateRecord::Kind::kFloor, 6, "m");
  last_floor.generation = kMaxGeneration + 1;  // "none left": still a floor
  const std::string bytes = EncodeStateRecord(ModelLoad(1, "m")) +
                            EncodeStateRecord(Apply(2, "m", 5, {})) + EncodeStateRecord(floor) +
                            EncodeStateRecord(apply) + EncodeStateRecord(publish) +
                            EncodeStateRecord(last_floor);
  JournalContents read = ParseJournal(bytes);
  ASSERT_EQ(read.records.size(), 3u);
  EXPECT_EQ(read.records[2].generation, kMaxGeneration + 1);
  ASSERT_EQ(read.problems.size(), 3u);
  EXPECT_NE(read.problems[0].what.find("generation floor \"m\" (seq 3): generation 18446744073709551614 "
                                       "is past the largest"),
            std::string::npos)
      << read.problems[0].what;
  EXPECT_NE(read.problems[1].what.find("apply \"m\" (seq 4)"), std::string::npos);
  EXPECT_NE(read.problems[2].what.find("publish \"m\" (seq 5)"), std::string::npos);
  RestorePlan plan = PlanRestore(read.records);
  ASSERT_EQ(plan.models.size(), 1u);
  EXPECT_EQ(plan.models[0].max_generation, kMaxGeneration);
}

TEST(StateJournalTest, NextGenerationNumbersNeverWrap) {
  EXPECT_EQ(*NextGenerationNumber("m", 1, 0), 2u);
  EXPECT_EQ(*NextGenerationNumber("m", 1, 9), 9u);
  EXPECT_EQ(*NextGenerationNumber("m", kMaxGeneration - 1, 0), kMaxGeneration);
  for (auto [current, floor] : {std::pair<uint64_t, uint64_t>{kMaxGeneration, 0},
                                {1, kMaxGeneration + 1},
                                {~uint64_t{0}, 0},
                                {1, ~uint64_t{0}}}) {
    auto next = NextGenerationNumber("m", current, floor);
    EXPECT_EQ(next.status().code(), absl::StatusCode::kFailedPrecondition) << current;
    EXPECT_NE(next.status().message().find("model \"m\" has no generation number left"),
              std::string::npos)
        << next.status();
  }
}

TEST(StateJournalTest, APathThatIsNotUtf8IsWrittenNotThrown) {
  StateRecord r = ModelLoad(1, "m");
  r.path = std::string("/models/\xff\xfe.safetensors");
  JournalContents read = ParseJournal(EncodeStateRecord(r));
  ASSERT_EQ(read.records.size(), 1u);
  EXPECT_NE(read.records[0].path, r.path);  // replaced bytes: that entry fails to restore
}

TEST(StateJournalTest, OpenAppendCommitAndReopen) {
  char tmpl[] = "/tmp/weightd-journal-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/state";
  {
    auto j = StateJournal::Open(dir);
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_TRUE((*j)->previous().records.empty());
    ASSERT_TRUE((*j)->Append(ModelLoad(1, "m")).ok());
    // Not committed: the journal is not there yet.
    EXPECT_NE(access((dir + "/journal").c_str(), F_OK), 0);
    ASSERT_TRUE((*j)->Commit().ok());
    ASSERT_TRUE((*j)->Append(ModelLoad(2, "n")).ok());  // into the committed file
  }
  {
    auto j = StateJournal::Open(dir);
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_EQ((*j)->previous().records.size(), 2u);
    EXPECT_EQ((*j)->previous().records[1].name, "n");
    // A crash before this one's Commit: the old journal stays.
  }
  auto j = StateJournal::Open(dir);
  ASSERT_TRUE(j.ok());
  EXPECT_EQ((*j)->previous().records.size(), 2u);
  std::string cmd = "rm -rf " + std::string(tmpl);
  ASSERT_EQ(std::system(cmd.c_str()), 0);
}

TEST(StateJournalTest, OpenRefusesAFileAsTheDirectory) {
  char tmpl[] = "/tmp/weightd-journal-XXXXXX";
  int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  auto j = StateJournal::Open(tmpl);
  EXPECT_FALSE(j.ok());
  unlink(tmpl);
}

}  // namespace
}  // namespace weightd
