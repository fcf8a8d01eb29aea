"""MGSM zero-shot over the chat endpoint, one eval per language (`mgsm_en`, `mgsm_de`, ...).

The one user message is the language's instruction (reason first, then a last line
"<prefix>: <integer>"), a blank line, and the question. The answer is the last number on the
first non-blank line after the last "<prefix>:" (any case, full-width colon too), read in the
language's digit convention; without such a line, the last number of the completion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal

from replaylm.eval.answers import find_numbers, normalise, parse_reference
from replaylm.eval.base import Endpoint, Example
from replaylm.eval.data import DataError, default_data_dir, read_tsv


@dataclass(frozen=True)
class Language:
    instruction: str  # asks for the reasoning, then "<answer_prefix>: <integer>" on the last line
    answer_prefix: str
    decimal_comma: bool = False  # numbers written "1.234,5" (see answers.py)


LANGUAGES: dict[str, Language] = {
    "en": Language(
        "Solve this math problem. Give the reasoning steps before giving the final answer on "
        'the last line by itself in the format of "Answer:". Do not add anything other than '
        'the integer answer after "Answer:".',
        "Answer",
    ),
    "es": Language(
        "Resuelve este problema de matemáticas. Explica los pasos de tu razonamiento antes de "
        'dar la respuesta final en la última línea, sola, con el formato "Respuesta:". No '
        'añadas nada más que la respuesta entera después de "Respuesta:".',
        "Respuesta",
        True,
    ),
    "fr": Language(
        "Résous ce problème de mathématiques. Donne les étapes de ton raisonnement avant de "
        'donner la réponse finale seule sur la dernière ligne, au format "Réponse:". N\'ajoute '
        'rien d\'autre que la réponse entière après "Réponse:".',
        "Réponse",
        True,
    ),
    "de": Language(
        "Löse diese Matheaufgabe. Gib die Schritte deiner Überlegung an, bevor du die "
        'endgültige Antwort allein in der letzten Zeile im Format "Antwort:" angibst. Schreibe '
        'nach "Antwort:" nichts außer der ganzzahligen Antwort.',
        "Antwort",
        True,
    ),
    "ru": Language(
        "Реши эту математическую задачу. Изложи шаги рассуждения, а затем дай окончательный "
        'ответ отдельно в последней строке в формате "Ответ:". После "Ответ:" не пиши ничего, '
        "кроме целого числа.",
        "Ответ",
        True,
    ),
    "zh": Language(
        '解决这道数学题。先写出推理步骤，再在最后一行单独给出最终答案，格式为"答案:"。'
        '"答案:"后面只写整数答案，不要添加任何其他内容。',
        "答案",
    ),
    "ja": Language(
        "この数学の問題を解いてください。最終的な答えを出す前に推論の過程を書き、最後の行に"
        "「答え:」の形式で答えだけを書いてください。「答え:」の後には整数の答え以外は何も"
        "書かないでください。",
        "答え",
    ),
    "th": Language(
        "จงแก้โจทย์คณิตศาสตร์ข้อนี้ แสดงขั้นตอนการให้เหตุผลก่อน แล้วจึงให้คำตอบสุดท้ายเพียงอย่างเดียว"
        'ในบรรทัดสุดท้ายในรูปแบบ "คำตอบ:" ห้ามเขียนสิ่งอื่นใดหลัง "คำตอบ:" นอกจากคำตอบที่เป็น'
        "จำนวนเต็ม",
        "คำตอบ",
    ),
    "sw": Language(
        "Tatua tatizo hili la hesabu. Eleza hatua za hoja zako kabla ya kutoa jibu la mwisho "
        'peke yake kwenye mstari wa mwisho kwa muundo wa "Jibu:". Usiongeze chochote isipokuwa '
        'jibu la namba kamili baada ya "Jibu:".',
        "Jibu",
    ),
    "bn": Language(
        "এই গণিতের সমস্যাটি সমাধান করুন। চূড়ান্ত উত্তর দেওয়ার আগে যুক্তির ধাপগুলো দেখান, তারপর "
        'শেষ লাইনে আলাদাভাবে "উত্তর:" বিন্যাসে চূড়ান্ত উত্তর দিন। "উত্তর:" এর পরে পূর্ণসংখ্যার '
        "উত্তর ছাড়া আর কিছু লিখবেন না।",
        "উত্তর",
    ),
    "te": Language(
        "ఈ గణిత సమస్యను పరిష్కరించండి. తుది సమాధానం ఇచ్చే ముందు మీ తర్క దశలను వివరించండి, "
        'తర్వాత చివరి పంక్తిలో "సమాధానం:" ఆకృతిలో తుది సమాధానాన్ని మాత్రమే ఇవ్వండి. '
        '"సమాధానం:" తర్వాత పూర్ణాంక సమాధానం తప్ప మరేమీ చేర్చవద్దు.',
        "సమాధానం",
    ),
}


@dataclass
class Mgsm:
    examples: list[Example]
    language: str
    endpoint: Endpoint = "chat/completions"
    stop: list[str] = field(default_factory=list)
    num_shots: int = 0

    def __post_init__(self) -> None:
        self._lang = LANGUAGES[self.language]
        prefix = re.escape(normalise(self._lang.answer_prefix))
        self._answer_line = re.compile(rf"{prefix}\W*?:[^\S\n]*\n*(?P<line>[^\n]*)", re.I)

    @property
    def name(self) -> str:
        return f"mgsm_{self.language}"

    @classmethod
    def load(cls, language: str, data_path: str | None) -> Mgsm:
        """The `language` questions from `data_path` (default: the shipped mgsm/mgsm_XX.tsv);
        rows are `question<TAB>answer`, the answer an English-convention number."""
        location = data_path or str(default_data_dir() / "mgsm" / f"mgsm_{language}.tsv")
        examples = []
        for n, (question, answer) in enumerate(read_tsv(location, columns=2), 1):
            try:
                examples.append(Example(question, parse_reference(answer)))
            except ValueError:
                raise DataError(f"{location} row {n}: answer {answer!r} is not a number") from None
        return cls(examples, language)

    def prompt(self, example: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self._lang.instruction}\n\n{example.question}"}]

    def parse(self, completion: str) -> Decimal | None:
        text = normalise(completion)
        lines = [m["line"] for m in self._answer_line.finditer(text)]
        for candidate in (lines[-1] if lines else "", text):
            numbers = find_numbers(candidate, self._lang.decimal_comma)
            if numbers:
                return numbers[-1]
        return None
