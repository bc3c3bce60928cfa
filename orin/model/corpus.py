"""The built-in text the demo tokenizer is trained on.

The demo models need a vocabulary that behaves like a real SentencePiece one
(multi-character pieces, common Chinese characters as single tokens, byte
fallback for the rest) without downloading anything, so the pieces are learned
from this fixed text. Changing a single character here changes the vocabulary,
and with it every generated model: bump ``demo.FORMAT_VERSION`` when editing.
"""

from __future__ import annotations

ENGLISH = """\
Running a large language model on an edge board is a different job from running it in a data \
center. The board has one shared pool of memory for the processor and the graphics engine, so \
every byte that the model weights take is a byte that the operating system, the camera pipeline \
and the other services cannot use. A quantized model with four or five bits per weight often \
fits where the full sixteen bit model would not, and the quality loss is small for most tasks.

The first thing to measure is the time to the first token. The prompt is processed in one large \
batch, which keeps the graphics cores busy, and then the model generates one token at a time. \
Generation is limited by memory bandwidth rather than by compute: each new token reads every \
weight once. A board with two hundred gigabytes per second of bandwidth can therefore generate \
roughly that many tokens per second divided by the size of the model in gigabytes.

The key and value cache grows with the context length and with the number of parallel \
sequences. A long context of eight thousand tokens can take more memory than a small model \
itself. Storing the cache in eight bit or four bit form saves memory at a small cost in \
accuracy, and flash attention keeps the cache reads fast. The service should check these \
numbers before it loads a model, not after the board runs out of memory.

Power modes matter as well. The board can run at fifteen, thirty or fifty watts, and the clocks \
of the processor, the memory and the graphics engine change with the mode. A test that passes \
at the highest power mode may be too slow at the lowest one. Record the power mode, the \
temperature and the clock speeds next to every benchmark result, so that two results can be \
compared fairly.

A dependable local service starts the model once, keeps it in memory, and answers requests \
from many clients. It streams tokens as soon as they are ready, stops cleanly when the client \
goes away, and reports clear errors when a request asks for more context than the model has. \
Logs should say what the service is doing without flooding the disk. When the model file is \
missing or damaged, the service should refuse to start and explain why in one line.

Small test models help to check all of this quickly. They are made from random weights with a \
fixed seed, so every run produces the same file and the same text. Their answers mean nothing, \
but they exercise the same code paths as a real model: loading, tokenizing, batching, sampling \
and streaming. A good test suite runs in seconds on a laptop and again on the board itself.

Questions to ask before deploying: How much memory is free after the system starts? Which \
quantization keeps the answers good enough? How many users will send requests at the same \
time? What happens when the board gets hot and the clocks drop? The answers decide the model \
size, the context length and the number of parallel slots.
"""

CHINESE = """\
在边缘设备上运行大语言模型，需要先考虑内存和功耗。
这块开发板的处理器和图形核心共用同一块内存，所以模型越小，系统越稳定。
量化可以把模型的权重从十六位压缩到四位或者五位，速度更快，质量损失很小。
生成文本的时候，每个新的词元都要读取一次全部权重，因此内存带宽决定了生成速度。
上下文越长，键值缓存占用的内存越多，服务在加载模型之前应该先检查这些数字。
我们用固定的随机种子生成测试模型，每次运行都会得到相同的文件和相同的输出。
请记录功耗模式、温度和时钟频率，这样不同的测试结果才能公平地比较。
一个可靠的本地服务只加载一次模型，然后同时回答多个用户的请求。
如果模型文件丢失或者损坏，服务应该拒绝启动，并用一句话说明原因。
今天的天气很好，我们在实验室里测试新的模型，大家都很高兴。
"""

CORPUS = ENGLISH + "\n" + CHINESE
