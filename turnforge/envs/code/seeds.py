"""The seed functions bugs are injected into: small, correct Python functions, each with unit
tests (plain ``assert`` test functions, run by ``RUNNER``). Every seed passes its own tests
(``tests/envs/test_code_repair.py`` checks it in the sandbox)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seed:
    name: str  # the module and function name
    source: str
    tests: str


SEEDS: tuple[Seed, ...] = (
    Seed("clamp", '''
def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
''', '''
def test_inside():
    assert clamp(5, 0, 10) == 5
    assert clamp(0, 0, 10) == 0

def test_below():
    assert clamp(-3, 0, 10) == 0

def test_above():
    assert clamp(12, 0, 10) == 10
    assert clamp(10, 0, 10) == 10
'''),
    Seed("running_max", '''
def running_max(xs):
    """The largest value seen so far, at each position of xs."""
    out = []
    best = None
    for x in xs:
        if best is None or x > best:
            best = x
        out.append(best)
    return out
''', '''
def test_increasing():
    assert running_max([1, 2, 3]) == [1, 2, 3]

def test_mixed():
    assert running_max([3, 1, 4, 1, 5]) == [3, 3, 4, 4, 5]

def test_empty_and_negative():
    assert running_max([]) == []
    assert running_max([-2, -5, -1]) == [-2, -2, -1]
'''),
    Seed("count_vowels", '''
def count_vowels(text):
    """How many of the letters of text are vowels (a, e, i, o, u; any case)."""
    count = 0
    for ch in text.lower():
        if ch in "aeiou":
            count += 1
    return count
''', '''
def test_words():
    assert count_vowels("banana") == 3
    assert count_vowels("rhythm") == 0

def test_case():
    assert count_vowels("AEIOU") == 5

def test_empty():
    assert count_vowels("") == 0
'''),
    Seed("binary_search", '''
def binary_search(xs, target):
    """Index of target in the sorted list xs, or -1."""
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', '''
def test_found():
    xs = [1, 3, 5, 7, 9, 11]
    assert [binary_search(xs, x) for x in xs] == [0, 1, 2, 3, 4, 5]

def test_missing():
    assert binary_search([1, 3, 5], 4) == -1
    assert binary_search([1, 3, 5], 0) == -1
    assert binary_search([1, 3, 5], 6) == -1

def test_empty():
    assert binary_search([], 1) == -1
'''),
    Seed("gcd", '''
def gcd(a, b):
    """Greatest common divisor of two non-negative integers."""
    while b != 0:
        a, b = b, a % b
    return a
''', '''
def test_common():
    assert gcd(12, 18) == 6
    assert gcd(17, 5) == 1

def test_zero():
    assert gcd(7, 0) == 7
    assert gcd(0, 9) == 9

def test_equal():
    assert gcd(8, 8) == 8
'''),
    Seed("chunk", '''
def chunk(xs, size):
    """xs cut into lists of size items (the last may be shorter)."""
    out = []
    for start in range(0, len(xs), size):
        out.append(xs[start:start + size])
    return out
''', '''
def test_even():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]

def test_ragged():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]

def test_small():
    assert chunk([], 3) == []
    assert chunk([1], 3) == [[1]]
'''),
    Seed("is_palindrome", '''
def is_palindrome(text):
    """Whether text reads the same backwards, ignoring case and non-letters."""
    letters = [ch.lower() for ch in text if ch.isalpha()]
    i, j = 0, len(letters) - 1
    while i < j:
        if letters[i] != letters[j]:
            return False
        i += 1
        j -= 1
    return True
''', '''
def test_yes():
    assert is_palindrome("racecar")
    assert is_palindrome("A man, a plan, a canal: Panama")

def test_no():
    assert not is_palindrome("hello")
    assert not is_palindrome("ab")

def test_trivial():
    assert is_palindrome("")
    assert is_palindrome("x")
'''),
    Seed("fizzbuzz", '''
def fizzbuzz(n):
    """The words of FizzBuzz for 1..n."""
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
''', '''
def test_start():
    assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]

def test_fifteen():
    assert fizzbuzz(15)[-1] == "FizzBuzz"
    assert len(fizzbuzz(15)) == 15

def test_zero():
    assert fizzbuzz(0) == []
'''),
    Seed("median", '''
def median(xs):
    """The median of a non-empty list of numbers."""
    ys = sorted(xs)
    n = len(ys)
    mid = n // 2
    if n % 2 == 1:
        return ys[mid]
    return (ys[mid - 1] + ys[mid]) / 2
''', '''
def test_odd():
    assert median([3, 1, 2]) == 2
    assert median([5]) == 5

def test_even():
    assert median([4, 1, 3, 2]) == 2.5

def test_unsorted_duplicates():
    assert median([7, 7, 1, 9, 7]) == 7
'''),
    Seed("rotate", '''
def rotate(xs, k):
    """xs rotated k places to the right."""
    if not xs:
        return []
    k = k % len(xs)
    return xs[len(xs) - k:] + xs[:len(xs) - k]
''', '''
def test_right():
    assert rotate([1, 2, 3, 4], 1) == [4, 1, 2, 3]

def test_wrap():
    assert rotate([1, 2, 3], 4) == [3, 1, 2]
    assert rotate([1, 2, 3], 3) == [1, 2, 3]

def test_empty():
    assert rotate([], 2) == []
'''),
    Seed("flatten", '''
def flatten(xss):
    """The items of a list of lists, in order."""
    out = []
    for xs in xss:
        for x in xs:
            out.append(x)
    return out
''', '''
def test_basic():
    assert flatten([[1, 2], [3], [4, 5]]) == [1, 2, 3, 4, 5]

def test_empty_parts():
    assert flatten([[], [1], []]) == [1]

def test_empty():
    assert flatten([]) == []
'''),
    Seed("is_leap_year", '''
def is_leap_year(year):
    """Whether year is a leap year of the Gregorian calendar."""
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
''', '''
def test_ordinary():
    assert is_leap_year(2024)
    assert not is_leap_year(2023)

def test_centuries():
    assert not is_leap_year(1900)
    assert is_leap_year(2000)

def test_early():
    assert is_leap_year(4)
    assert not is_leap_year(1)
'''),
    Seed("sum_of_squares", '''
def sum_of_squares(n):
    """1*1 + 2*2 + ... + n*n."""
    total = 0
    for i in range(1, n + 1):
        total += i * i
    return total
''', '''
def test_small():
    assert sum_of_squares(1) == 1
    assert sum_of_squares(3) == 14

def test_larger():
    assert sum_of_squares(10) == 385

def test_zero():
    assert sum_of_squares(0) == 0
'''),
    Seed("first_negative", '''
def first_negative(xs):
    """Index of the first negative number of xs, or -1."""
    for i in range(len(xs)):
        if xs[i] < 0:
            return i
    return -1
''', '''
def test_found():
    assert first_negative([3, -1, -2]) == 1
    assert first_negative([-5]) == 0

def test_none():
    assert first_negative([0, 1, 2]) == -1

def test_empty():
    assert first_negative([]) == -1
'''),
    Seed("word_lengths", '''
def word_lengths(text):
    """Length of each word of text (words are separated by spaces)."""
    lengths = []
    for word in text.split():
        lengths.append(len(word))
    return lengths
''', '''
def test_sentence():
    assert word_lengths("the quick brown fox") == [3, 5, 5, 3]

def test_spaces():
    assert word_lengths("  a  bb ") == [1, 2]

def test_empty():
    assert word_lengths("") == []
'''),
    Seed("digits_sum", '''
def digits_sum(n):
    """Sum of the decimal digits of a non-negative integer."""
    total = 0
    while n > 0:
        total += n % 10
        n = n // 10
    return total
''', '''
def test_small():
    assert digits_sum(7) == 7
    assert digits_sum(0) == 0

def test_larger():
    assert digits_sum(1234) == 10
    assert digits_sum(9009) == 18

def test_round():
    assert digits_sum(1000) == 1
'''),
    Seed("count_inside", '''
def count_inside(xs, lo, hi):
    """How many items of xs lie in the closed range [lo, hi]."""
    count = 0
    for x in xs:
        if lo <= x and x <= hi:
            count += 1
    return count
''', '''
def test_some():
    assert count_inside([1, 5, 10, 15], 5, 10) == 2

def test_bounds():
    assert count_inside([5, 10], 5, 10) == 2
    assert count_inside([4, 11], 5, 10) == 0

def test_empty():
    assert count_inside([], 0, 1) == 0
'''),
    Seed("dedupe", '''
def dedupe(xs):
    """The items of xs without repeats, in order of first appearance."""
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
''', '''
def test_repeats():
    assert dedupe([1, 2, 1, 3, 2]) == [1, 2, 3]

def test_strings():
    assert dedupe(["b", "a", "b"]) == ["b", "a"]

def test_empty():
    assert dedupe([]) == []
'''),
    Seed("pairwise_diffs", '''
def pairwise_diffs(xs):
    """Differences between consecutive items: xs[1] - xs[0], xs[2] - xs[1], ..."""
    out = []
    for i in range(1, len(xs)):
        out.append(xs[i] - xs[i - 1])
    return out
''', '''
def test_basic():
    assert pairwise_diffs([1, 4, 9, 16]) == [3, 5, 7]

def test_negative():
    assert pairwise_diffs([5, 2]) == [-3]

def test_short():
    assert pairwise_diffs([1]) == []
    assert pairwise_diffs([]) == []
'''),
    Seed("triangle_kind", '''
def triangle_kind(a, b, c):
    """'equilateral', 'isosceles', 'scalene', or 'invalid' for side lengths a, b, c."""
    x, y, z = sorted([a, b, c])
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"
''', '''
def test_kinds():
    assert triangle_kind(3, 3, 3) == "equilateral"
    assert triangle_kind(3, 3, 5) == "isosceles"
    assert triangle_kind(3, 4, 5) == "scalene"

def test_invalid():
    assert triangle_kind(1, 2, 3) == "invalid"
    assert triangle_kind(0, 1, 1) == "invalid"

def test_order():
    assert triangle_kind(5, 3, 3) == "isosceles"
'''),
)

# Runs tests/test_*.py: each test function in turn, one line per test, then the summary line.
# The env scores with its own pristine copy of this runner and of the tests.
RUNNER = '''
import importlib.util, pathlib, sys, traceback
sys.path.insert(0, "pkg")
passed = failed = 0
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        print(f"ERROR {path}: {type(err).__name__}: {err}")
        failed += 1
        continue
    for name in sorted(n for n in dir(module) if n.startswith("test_")):
        try:
            getattr(module, name)()
        except BaseException as err:
            line = traceback.extract_tb(err.__traceback__)[-1].line
            print(f"FAIL {name}: {type(err).__name__} {err} | {line}")
            failed += 1
        else:
            print(f"PASS {name}")
            passed += 1
print(f"{passed} passed, {failed} failed")
'''
