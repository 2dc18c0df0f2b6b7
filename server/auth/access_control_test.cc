#include "server/auth/access_control.h"

#include <gtest/gtest.h>

#include "server/grpc/call_auth.h"

namespace weightd {
namespace {

Principal Unix(uid_t uid, gid_t gid, std::vector<gid_t> groups = {}) {
  PeerIdentity id;
  id.uid = uid;
  id.gid = gid;
  id.groups = std::move(groups);
  return Principal::UnixPeer(id);
}

ReaderList Readers(const std::string& spec) {
  auto r = ReaderList::Parse({spec});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ReaderList();
}

constexpr uid_t kDaemon = 4242;

AccessPolicy Policy(AccessPolicyOptions o = {}) {
  o.daemon_uid = kDaemon;
  return AccessPolicy(std::move(o));
}

TEST(ReaderListTest, ParsesEveryKindAndDropsDuplicates) {
  auto r = ReaderList::Parse({"uid:1000, gid:2000", "token:alice,cn:svc.example", "uid:1000"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ToStrings(),
            (std::vector<std::string>{"uid:1000", "gid:2000", "token:alice", "cn:svc.example"}));
  EXPECT_TRUE(ReaderList::Parse({}).value().empty());
  EXPECT_TRUE(ReaderList::Parse({"", " , "}).value().empty());
}

TEST(ReaderListTest, MalformedEntriesAreInvalidArgument) {
  for (const char* bad : {"1000", "uid:", "uid:abc", "uid:-1", "user:1", "token:", "cn:"}) {
    auto r = ReaderList::Parse({bad});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ReaderListTest, AdmitsOnlyMatchingPrincipalsOfTheRightKind) {
  ReaderList r = Readers("uid:1000,gid:2000,token:alice,cn:bob");
  EXPECT_TRUE(r.Admits(Unix(1000, 1)));
  EXPECT_TRUE(r.Admits(Unix(7, 2000)));             // primary group
  EXPECT_TRUE(r.Admits(Unix(7, 7, {5, 2000})));     // supplementary group
  EXPECT_FALSE(r.Admits(Unix(7, 7, {5})));
  EXPECT_TRUE(r.Admits(Principal::Tcp("alice", "")));
  EXPECT_TRUE(r.Admits(Principal::Tcp("", "bob")));
  EXPECT_FALSE(r.Admits(Principal::Tcp("bob", "")));   // a token is not a CN
  EXPECT_FALSE(r.Admits(Principal::Tcp("", "alice")));
  EXPECT_FALSE(r.Admits(Principal::Tcp("", "")));
  EXPECT_TRUE(ReaderList().Admits(Principal::Tcp("", "")));  // empty = public
}

TEST(AccessPolicyTest, EmptyAllowListAdmitsEveryPeer) {
  EXPECT_TRUE(Policy().AdmitPeer(Unix(12345, 12345)).ok());
}

TEST(AccessPolicyTest, AllowListRefusesOthersAndAlwaysAdmitsTheDaemonUid) {
  AccessPolicyOptions o;
  o.allow_uids = {1000};
  o.allow_gids = {3000};
  AccessPolicy p = Policy(o);
  EXPECT_TRUE(p.AdmitPeer(Unix(1000, 1)).ok());
  EXPECT_TRUE(p.AdmitPeer(Unix(1001, 3000)).ok());
  EXPECT_TRUE(p.AdmitPeer(Unix(1001, 1, {3000})).ok());
  EXPECT_TRUE(p.AdmitPeer(Unix(kDaemon, kDaemon)).ok());
  absl::Status refused = p.AdmitPeer(Unix(0, 0));  // root is not implicit
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(refused.message().find("uid 0"), std::string::npos) << refused;
  EXPECT_TRUE(p.AdmitPeer(Principal::Tcp("", "")).ok());  // TCP: tokens decide
}

TEST(AccessPolicyTest, AdminsAreEveryoneUntilListed) {
  EXPECT_TRUE(Policy().CheckAdmin(Unix(5, 5), "load models").ok());
  EXPECT_TRUE(Policy().CheckAdmin(Principal::Tcp("", ""), "load models").ok());
  AccessPolicyOptions o;
  o.admin_uids = {1000};
  o.admin_gids = {3000};
  o.admin_token_names = {"ops"};
  AccessPolicy p = Policy(o);
  EXPECT_TRUE(p.CheckAdmin(Unix(1000, 1), "x").ok());
  EXPECT_TRUE(p.CheckAdmin(Unix(9, 9, {3000}), "x").ok());
  EXPECT_TRUE(p.CheckAdmin(Unix(kDaemon, 1), "x").ok());
  EXPECT_TRUE(p.CheckAdmin(Principal::Tcp("ops", ""), "x").ok());
  EXPECT_TRUE(p.CheckAdmin(Principal::Internal(), "x").ok());
  absl::Status s = p.CheckAdmin(Unix(9, 9), "unload models");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("may not unload models"), std::string::npos) << s;
  EXPECT_EQ(p.CheckAdmin(Principal::Tcp("dev", ""), "x").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(p.CheckAdmin(Principal::Tcp("", "ops"), "x").code(),  // a CN is not a token
            absl::StatusCode::kPermissionDenied);
}

TEST(AccessPolicyTest, PeerRpcsAreForListedFleetMembersOnly) {
  // None listed: nobody, not even the daemon's uid or an admin, and the
  // refusal names the flag.
  for (const Principal& p : {Unix(kDaemon, 1), Unix(5, 5), Principal::Tcp("fleet", ""),
                             Principal::Tcp("", "")}) {
    absl::Status s = Policy().CheckFleetMember(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << p.Describe();
    EXPECT_NE(s.message().find("--fleet-members"), std::string::npos) << s;
  }
  AccessPolicyOptions o;
  o.fleet_members = Readers("token:fleet,cn:node-a");
  o.admin_uids = {1000};
  AccessPolicy p = Policy(o);
  EXPECT_TRUE(p.CheckFleetMember(Principal::Tcp("fleet", "")).ok());
  EXPECT_TRUE(p.CheckFleetMember(Principal::Tcp("", "node-a")).ok());
  EXPECT_TRUE(p.CheckFleetMember(Principal::Tcp("other", "node-a")).ok());
  for (const Principal& q : {Principal::Tcp("other", ""), Principal::Tcp("", "fleet"),
                             Principal::Tcp("", ""), Unix(1000, 1), Unix(kDaemon, 1)}) {
    absl::Status s = p.CheckFleetMember(q);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << q.Describe();
    EXPECT_NE(s.message().find("is not a fleet member"), std::string::npos) << s;
  }
  EXPECT_TRUE(Readers("token:a,cn:b").OnlyTcpIdentities());
  EXPECT_FALSE(Readers("token:a,uid:5").OnlyTcpIdentities());
}

TEST(AccessPolicyTest, ReadNeedsEveryGuard) {
  AccessPolicy p = Policy();
  std::vector<ReadGuard> guards = {{"model \"m\"", Readers("uid:1,uid:2")},
                                   {"adapter \"a\"", Readers("uid:2")}};
  EXPECT_TRUE(p.CheckRead(Unix(2, 2), guards).ok());
  absl::Status s = p.CheckRead(Unix(1, 1), guards);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("adapter \"a\""), std::string::npos) << s;
  EXPECT_EQ(p.CheckRead(Unix(3, 3), guards).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(p.CheckRead(Unix(kDaemon, 3), guards).ok());
  EXPECT_TRUE(p.CheckRead(Principal::Internal(), guards).ok());
  EXPECT_TRUE(p.CheckRead(Unix(3, 3), {}).ok());
}

TEST(AccessPolicyTest, LeaseOfAPublicModelIsForItsFetcherOnly) {
  AccessPolicy p = Policy();
  LeaseOwner owner{Unix(1000, 1000), {}};
  EXPECT_TRUE(p.CheckLeaseUse(Unix(1000, 5), 7, owner).ok());
  absl::Status s = p.CheckLeaseUse(Unix(1001, 1000), 7, owner);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("lease 7 was fetched by uid 1000"), std::string::npos) << s;
  // Fetched over TCP, attached on the data socket: anyone who may read it.
  LeaseOwner tcp{Principal::Tcp("alice", ""), {}};
  EXPECT_TRUE(p.CheckLeaseUse(Unix(1001, 1001), 8, tcp).ok());
  EXPECT_EQ(p.CheckLeaseUse(Principal::Tcp("bob", ""), 8, tcp).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(AccessPolicyTest, LeaseOfAPrivateGenerationIsForItsReaders) {
  AccessPolicy p = Policy();
  LeaseOwner owner{Unix(1000, 1000), {{"model \"m\"", Readers("uid:1000,uid:1001")}}};
  EXPECT_TRUE(p.CheckLeaseUse(Unix(1001, 1001), 9, owner).ok());
  EXPECT_EQ(p.CheckLeaseUse(Unix(1002, 1002), 9, owner).code(),
            absl::StatusCode::kPermissionDenied);
  LeaseOwner tcp{Principal::Tcp("alice", ""), {{"model \"m\"", Readers("token:alice")}}};
  EXPECT_EQ(p.CheckLeaseUse(Unix(1000, 1000), 9, tcp).code(), absl::StatusCode::kPermissionDenied);
}

TEST(ParseIdListTest, NumbersOnly) {
  EXPECT_EQ(ParseIdList("--allow-uid", "1000, 1001,,").value(),
            (std::vector<uint32_t>{1000, 1001}));
  auto bad = ParseIdList("--allow-uid", "1000,root");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("root"), std::string::npos);
}

TEST(BearerTokensTest, NamedAndBareTokens) {
  auto t = BearerTokens::Parse("# comment\nalice 0123456789abcdefXYZ\n\n  fedcba9876543210zz \n",
                               "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->Authenticate("Bearer 0123456789abcdefXYZ").value(), "alice");
  EXPECT_EQ(t->Authenticate("bearer   fedcba9876543210zz").value(), "token-4");
}

TEST(BearerTokensTest, MissingMalformedOrUnknownIsUnauthenticated) {
  auto t = BearerTokens::Parse("alice 0123456789abcdefXYZ\n", "tokens");
  ASSERT_TRUE(t.ok());
  for (std::optional<absl::string_view> bad :
       {std::optional<absl::string_view>(), std::optional<absl::string_view>("0123456789abcdefXYZ"),
        std::optional<absl::string_view>("Basic 0123456789abcdefXYZ"),
        std::optional<absl::string_view>("Bearer 0123456789abcdefXY"),
        std::optional<absl::string_view>("Bearer 0123456789abcdefXYZZ"),
        std::optional<absl::string_view>("Bearer ")}) {
    EXPECT_EQ(t->Authenticate(bad).status().code(), absl::StatusCode::kUnauthenticated)
        << (bad ? *bad : "(none)");
  }
}

TEST(BearerTokensTest, BadFilesAreRefused) {
  EXPECT_EQ(BearerTokens::Parse("alice short\n", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Parse("a 0123456789abcdefXYZ\nb 0123456789abcdefXYZ\n", "f")
                .status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Parse("a 0123456789abcdefXYZ\na 0123456789abcdefXYQ\n", "f")
                .status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Parse("a b c\n", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Parse("bad/name 0123456789abcdefXYZ\n", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Parse("# only comments\n", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BearerTokens::Load("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ReadScopeTest, EqualExactlyWhenTheGuardsAdmitTheSamePrincipals) {
  auto guard = [](const std::string& spec) { return ReadGuard{"x", Readers(spec)}; };
  EXPECT_EQ(ReadScope({}), "");
  EXPECT_EQ(ReadScope({guard("")}), "") << "a public guard is no condition";
  // Order of rules, of guards, duplicates and public guards do not matter.
  EXPECT_EQ(ReadScope({guard("uid:1,gid:2"), guard("token:a")}),
            ReadScope({guard("token:a"), guard(""), guard("gid:2,uid:1,uid:1"), guard("token:a")}));
  // A private model and the same model with a public adapter applied.
  EXPECT_EQ(ReadScope({guard("uid:1")}), ReadScope({guard("uid:1"), guard("")}));
  // Anything else differs: another reader, one guard more, a public scope.
  EXPECT_NE(ReadScope({guard("uid:1")}), ReadScope({guard("uid:2")}));
  EXPECT_NE(ReadScope({guard("uid:1")}), ReadScope({guard("uid:1"), guard("gid:5")}));
  EXPECT_NE(ReadScope({guard("uid:1")}), ReadScope({guard("uid:1,gid:5")}));
  EXPECT_NE(ReadScope({guard("uid:1")}), "");
  // Names are free text: separators inside them cannot forge another list.
  EXPECT_NE(ReadScope({guard("cn:a}1{cn:b")}), ReadScope({guard("cn:a"), guard("cn:b")}));
  EXPECT_NE(ReadScope({guard("cn:a&b")}), ReadScope({guard("cn:a"), guard("cn:b")}));
}

TEST(ListenAddressTest, LoopbackNames) {
  EXPECT_TRUE(IsLoopbackListenAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackListenAddress("127.1.2.3:1"));
  EXPECT_TRUE(IsLoopbackListenAddress("localhost:1"));
  EXPECT_TRUE(IsLoopbackListenAddress("[::1]:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("0.0.0.0:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("[::]:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("10.0.0.1:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("127.example.com:1"));
  EXPECT_FALSE(IsLoopbackListenAddress("127.a.b.c:1"));
  EXPECT_FALSE(IsLoopbackListenAddress(":1"));
}

}  // namespace
}  // namespace weightd
