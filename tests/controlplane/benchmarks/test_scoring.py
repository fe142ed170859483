"""Answers scored as the field scores them: VQAv2's normalisation and accuracy, DocVQA's ANLS,
ChartQA's relaxed accuracy, POPE's yes/no reading and figures, each with a 95 % interval."""

from __future__ import annotations

import pytest

from controlplane import intervals
from controlplane.benchmarks import presence, scoring


@pytest.mark.parametrize("answer, expected, em", [
    ("The Eiffel Tower.", "eiffel tower", 1.0),
    ("  42  ", "42", 1.0),
    ("42.5", "42", 0.0),
    ("$42.50", ["42.50", "$42.50"], 1.0),  # any accepted answer
    ("Two", "2", 1.0),  # number words as digits
    ("dont", "don't", 1.0),  # contractions with their apostrophe
    ("1,234", "1234", 1.0),
    ("3.", "3", 1.0),
    ("3.5", "35", 0.0),  # a decimal point stays
])
def test_exact_match_normalises_as_vqa_does(answer, expected, em):
    assert scoring.exact_match(answer, expected) == em


def test_vqa_accuracy_averages_min_of_matches_over_three_across_ten_references():
    assert scoring.vqa_accuracy("two", ["2"] * 2 + ["3"] * 8) == pytest.approx(0.6)
    assert scoring.vqa_accuracy("2", ["2"] * 3 + ["3"] * 7) == pytest.approx(0.9)
    assert scoring.vqa_accuracy("2", ["2"] * 4 + ["3"] * 6) == 1.0
    assert scoring.vqa_accuracy("4", ["2"] * 10) == 0.0


def test_vqa_accuracy_with_fewer_than_ten_references_is_a_plain_match():
    assert scoring.vqa_accuracy("A dog.", ["dog", "puppy"]) == 1.0
    assert scoring.vqa_accuracy("cat", ["dog", "puppy"]) == 0.0


def test_anls_is_one_minus_the_normalised_edit_distance_and_zero_from_half():
    assert scoring.anls("TOTAL 42.50", "total 42.50") == 1.0
    assert scoring.anls("4250", "42.50") == pytest.approx(0.8)  # one edit in five characters
    assert scoring.anls("hello", "world") == 0.0  # distance 0.8
    assert scoring.anls("abcd", "abxy") == 0.0  # distance exactly 0.5: DocVQA counts it 0
    assert scoring.anls("invoice 17", ["receipt 17", "invoice 17"]) == 1.0  # the nearest reference
    assert scoring.levenshtein("kitten", "sitting") == 3


@pytest.mark.parametrize("answer, expected, right", [
    ("1,234", "1200", True),  # 2.8 % off
    ("1,300", "1234", False),  # 5.3 % off
    ("12.5%", "12.5", True), ("12.5%", "0.125", True),
    ("$3", "3.1", True),
    ("The value is 1,234.", "1234", True),  # the one number a sentence states
    ("Between 2019 and 2020", "2020", False),  # two numbers: not read as either
    ("0", "0", True), ("0.01", "0", False),
    ("Paris", "paris", True), ("Lyon", "Paris", False),  # not numbers: exact match
])
def test_relaxed_accuracy_takes_numbers_within_five_percent(answer, expected, right):
    assert scoring.relaxed_accuracy(answer, expected) == float(right)


def test_counts_are_exact_match_on_the_number_stated():
    assert scoring.score("There are three dogs.", ["3"], "count")["score"] == 1.0
    assert scoring.score("4", ["3"], "count")["score"] == 0.0
    assert scoring.score("3 or 4", ["3"], "count")["score"] == 0.0


@pytest.mark.parametrize("answer, reading", [
    ("There isn't a giraffe.", "no"),
    ("I don't see any giraffe", "no"),
    ("No.", "no"), ("There is no dog in this picture.", "no"), ("The image does not contain a cat", "no"),
    ("Nothing like that.", "no"), ("No giraffe is visible.", "no"), ("No. It is a zebra.", "no"),
    ("Yes.", "yes"), ("yes, there is one", "yes"), ("There are two giraffes.", "yes"),
    ("Yes, but it is not very clear.", "yes"),
    ("No, but there is a giraffe on the left.", "unclear"),  # denies, then asserts the object
    ("I'm not sure.", "unclear"), ("", "unclear"),
    ("Notably, a dog sits there.", "yes"),  # no verdict and no negation: yes, as POPE reads it
])
def test_presence_answers_are_read_as_yes_no_or_unclear(answer, reading):
    assert presence.classify(answer) == reading


def test_a_denial_that_asserts_the_object_is_no_correct_no():
    assert scoring.score("No, but there is a giraffe on the left.", ["no"], "presence")["score"] == 0.0
    assert scoring.score("There isn't a giraffe.", ["no"], "presence")["score"] == 1.0


def test_pope_figures_take_yes_as_the_positive_class():
    # 4 present (truth yes): 3 answered yes, 1 no; 4 absent: 1 yes, 2 no, 1 unclear.
    pairs = [("yes", "yes")] * 3 + [("yes", "no")] + [("no", "yes")] + [("no", "no")] * 2 + [("no", "unclear")]
    figures = presence.pope(pairs)
    assert (figures["tp"], figures["fp"], figures["tn"], figures["fn"], figures["unclear"]) == (3, 1, 2, 1, 1)
    assert figures["accuracy"] == pytest.approx(5 / 8)
    assert figures["precision"] == pytest.approx(3 / 4) and figures["recall"] == pytest.approx(3 / 4)
    assert figures["f1"] == pytest.approx(0.75) and figures["yes_ratio"] == pytest.approx(4 / 8)
    low, high = figures["f1_ci"]
    assert low <= 0.75 <= high and high - low > 0.1


def test_presence_is_summarised_by_f1_with_pope_figures():
    results = [scoring.score(a, [t], "presence") for a, t in
               [("Yes", "yes"), ("yes", "yes"), ("No", "no"), ("Yes", "no")]]
    summary = scoring.summarise("presence", results)
    assert summary["metric"] == "f1" and summary["value"] == pytest.approx(0.8)
    assert summary["pope"]["accuracy"] == 0.75 and summary["pope"]["yes_ratio"] == 0.75


def test_wilson_interval_matches_the_textbook_and_stays_within_zero_and_one():
    low, high = intervals.wilson(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = intervals.wilson(0, 20)
    assert low == 0.0 and 0.15 < high < 0.17
    assert intervals.wilson(0, 0) is None


def test_graded_scores_get_a_seeded_bootstrap_interval_that_narrows_with_more_items():
    scores = [0.2, 0.9, 0.7, 1.0, 0.4, 0.8] * 5
    first, again = intervals.mean_interval(scores), intervals.mean_interval(scores)
    assert first == again  # seeded: the same answers, the same interval
    mean = sum(scores) / len(scores)
    assert first[0] < mean < first[1]
    wide = intervals.mean_interval(scores[:6])
    assert wide[1] - wide[0] > first[1] - first[0]


def test_two_caps_far_apart_have_intervals_that_do_not_overlap():
    low_cap = scoring.summarise("read", [{"score": s, "exact_match": 0.0} for s in [0.0, 0.55, 0.6] * 20])
    high_cap = scoring.summarise("read", [{"score": s, "exact_match": 1.0} for s in [1.0, 0.9, 0.95] * 20])
    assert low_cap["metric"] == "anls" and low_cap["interval"][1] < high_cap["interval"][0]
    counts = scoring.summarise("count", [{"score": float(i % 2), "exact_match": float(i % 2)} for i in range(40)])
    assert counts["interval"] == [round(v, 4) for v in intervals.wilson(20, 40)]  # 0/1 scores: Wilson


def test_every_task_type_has_one_headline_metric():
    assert {t: task.metric for t, task in scoring.TASKS.items()} == {
        "read": "anls", "chart": "relaxed_accuracy", "count": "exact_match", "presence": "f1",
        "description": "anls", "reasoning": "vqa_accuracy", "long": "anls"}
