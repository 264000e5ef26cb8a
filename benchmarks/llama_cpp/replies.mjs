// llama.cpp (node-llama-cpp's prebuilt build) on an exported GGUF: greedy replies to the prompts, and tokens/s.
import fs from "node:fs";
import {getLlama} from "node-llama-cpp";
const [modelPath, promptsPath, outPath, maxNew, threads] = process.argv.slice(2);
const {prompts} = JSON.parse(fs.readFileSync(promptsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 512, threads: Number(threads), batchSize: 512});
const seq = context.getSequence();
const replies = [];
let generated = 0, genMs = 0;
const t0 = performance.now();
for (const prompt of prompts) {
  await seq.clearHistory();
  const tokens = model.tokenize(prompt, true);
  const out = [];
  const g0 = performance.now();
  for await (const token of seq.evaluate(tokens, {temperature: 0})) {
    if (model.isEogToken(token)) break;
    out.push(token);
    if (out.length >= Number(maxNew)) break;
  }
  genMs += performance.now() - g0;
  generated += out.length;
  replies.push(model.detokenize(out));
}
const wall = (performance.now() - t0) / 1000;
fs.writeFileSync(outPath, JSON.stringify({model: modelPath, llama_cpp: llama.buildType ?? null,
  replies, generated_tokens: generated, seconds: wall, tokens_per_s: generated / (genMs / 1000)}, null, 1));
console.log(modelPath, "replies", replies.length, "tokens", generated, "s", wall.toFixed(1), "tok/s",
  (generated / (genMs / 1000)).toFixed(1));
await context.dispose(); await model.dispose();
