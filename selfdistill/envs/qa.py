"""Questions with reference answers: reward 1/0, feedback reveals the answer (or not).

Scoring is `selfdistill.data.is_correct` (any reference occurs in the completion,
case-insensitively). With `reveal=True` the feedback names the expected answer (kind
`ground_truth`, the SDFT-style privileged context); with `reveal=False` it says only "Correct." /
"Incorrect." (kind `verdict`), for when the teacher must not see the answer.
"""

from __future__ import annotations

from selfdistill.chat import Message, to_messages
from selfdistill.data import is_correct
from selfdistill.envs.base import Feedback


class QAEnv:
    """One question with one or more accepted answers."""

    def __init__(
        self, prompt: str | list[Message], answers: list[str] | str, *, reveal: bool = True
    ) -> None:
        self.messages = to_messages(prompt)
        self.answers = [answers] if isinstance(answers, str) else list(answers)
        if not self.answers or not all(isinstance(a, str) and a.strip() for a in self.answers):
            raise ValueError("QAEnv needs at least one non-empty answer string")
        self.reveal = reveal

    def step(self, completion: str) -> Feedback:
        """1.0 when any reference answer occurs in `completion`, else 0.0."""
        correct = is_correct(completion, self.answers)
        verdict = "Correct." if correct else "Incorrect."
        evidence = {"correct": correct, "answers": self.answers}
        if not self.reveal:
            return Feedback(float(correct), verdict, "verdict", correct, evidence)
        if len(self.answers) == 1:
            reveal = f"The expected answer is: {self.answers[0]}"
        else:
            reveal = "Accepted answers: " + "; ".join(self.answers)
        return Feedback(float(correct), f"{verdict} {reveal}", "ground_truth", correct, evidence)
