#include "rolloutcore/base/metrics_writer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace rc {
namespace {

TEST(MetricsWriterTest, EscapesBackslashQuoteAndNewlineInLabelValues) {
  EXPECT_EQ(EscapeLabelValue(R"(a\b)"), R"(a\\b)");
  EXPECT_EQ(EscapeLabelValue(R"(say "hi")"), R"(say \"hi\")");
  EXPECT_EQ(EscapeLabelValue("two\nlines"), R"(two\nlines)");
  EXPECT_EQ(EscapeLabelValue("plain-name_0.9"), "plain-name_0.9");
  // Help text escapes backslash and newline, not quotes.
  EXPECT_EQ(EscapeHelpText("a \"b\"\\\nc"), "a \"b\"\\\\\\nc");
}

TEST(MetricsWriterTest, AHostileLabelValueStaysInsideItsSample) {
  MetricsWriter w;
  // Unescaped, this value would close the label, end the line and forge a second sample.
  const std::string hostile = "m\"} 1\nrolloutcore_forged_total{x=\"\\";
  w.Metric("rolloutcore_steps_total", MetricType::kCounter, "Steps.", {{"model_name", hostile}}, int64_t{3});
  const std::string text = w.Text();
  EXPECT_EQ(text,
            "# HELP rolloutcore_steps_total Steps.\n"
            "# TYPE rolloutcore_steps_total counter\n"
            "rolloutcore_steps_total{model_name=\"m\\\"} 1\\nrolloutcore_forged_total{x=\\\"\\\\\"} 3\n");
  // Exactly three lines: the forged sample did not become a line of its own.
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3);
}

TEST(MetricsWriterTest, WritesFamiliesLabelsInOrderAndNumbersAsStreamsDo) {
  MetricsWriter w;
  const MetricLabels base = {{"engine", "e0"}};
  w.Family("rolloutcore_phase_ms", MetricType::kGauge, "Phase time.");
  w.Sample("rolloutcore_phase_ms", WithLabel(base, "phase", "drain"), 1.5);
  w.Sample("rolloutcore_phase_ms", WithLabel(base, "phase", "install"), 2.0 / 3.0);
  w.Metric("rolloutcore_paused", MetricType::kGauge, "Paused.", {}, true);
  w.Sample("rolloutcore_big", {}, uint64_t{18446744073709551615ull});
  EXPECT_EQ(w.Text(),
            "# HELP rolloutcore_phase_ms Phase time.\n"
            "# TYPE rolloutcore_phase_ms gauge\n"
            "rolloutcore_phase_ms{engine=\"e0\",phase=\"drain\"} 1.5\n"
            "rolloutcore_phase_ms{engine=\"e0\",phase=\"install\"} 0.666667\n"
            "# HELP rolloutcore_paused Paused.\n"
            "# TYPE rolloutcore_paused gauge\n"
            "rolloutcore_paused 1\n"
            "rolloutcore_big 18446744073709551615\n");
  EXPECT_EQ(base.size(), 1u) << "WithLabel copies; the page's labels are unchanged";
}

}  // namespace
}  // namespace rc
