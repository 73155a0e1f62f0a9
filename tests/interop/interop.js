// The Node BullMQ side of sdcore's interop test. Prints one JSON object per line on stdout.
//
//   node interop.js work    <redisUrl> <prefix> <queue> <count>  consume <count> jobs, then exit
//   node interop.js add     <redisUrl> <prefix> <queue> <count>  add jobs (attempts 3, exponential)
//   node interop.js ids     <redisUrl> <prefix> <queue> <id>...  try custom job ids, report each
//   node interop.js inspect <redisUrl> <prefix> <queue> <id>...  state and returnvalue of jobs
//
// <redisUrl> is a redis:// URL, or redis+cluster://host:port[,host:port...] for an ioredis
// Cluster started from those nodes (the prefix must then hold a hash tag, e.g. {bull}).
'use strict';

const { Queue, Worker, Job } = require('bullmq');
const IORedis = require('ioredis');

function emit(obj) {
  process.stdout.write(`${JSON.stringify(obj)}\n`);
}

async function work(connection, prefix, queue, count) {
  let seen = 0;
  let resolveDone;
  const done = new Promise((resolve) => {
    resolveDone = resolve;
  });
  const worker = new Worker(
    queue,
    async (job) => {
      emit({
        event: 'processed',
        id: job.id,
        name: job.name,
        data: job.data,
        attemptsMade: job.attemptsMade,
        opts: job.opts,
      });
      seen += 1;
      if (seen >= count) resolveDone();
      return { handledBy: 'node', id: job.id };
    },
    { connection, prefix },
  );
  worker.on('error', (err) => emit({ event: 'error', message: String(err) }));
  await done;
  await worker.close();
}

async function add(connection, prefix, queue, count) {
  const q = new Queue(queue, { connection, prefix });
  for (let i = 0; i < count; i += 1) {
    const job = await q.add(
      'from-node',
      { n: i, text: 'héllo', nested: { list: [1, 2, 3] } },
      { attempts: 3, backoff: { type: 'exponential', delay: 100 }, removeOnComplete: { age: 3600 } },
    );
    emit({ event: 'added', id: job.id });
  }
  await q.close();
}

async function ids(connection, prefix, queue, jobIds) {
  const q = new Queue(queue, { connection, prefix });
  for (const jobId of jobIds) {
    try {
      const job = await q.add('id-check', { jobId }, { jobId });
      emit({ event: 'id', jobId, ok: true, id: job.id });
    } catch (err) {
      emit({ event: 'id', jobId, ok: false, error: err.message });
    }
  }
  await q.close();
}

async function inspect(connection, prefix, queue, jobIds) {
  const q = new Queue(queue, { connection, prefix });
  for (const jobId of jobIds) {
    const job = await Job.fromId(q, jobId);
    emit({
      event: 'job',
      id: jobId,
      found: Boolean(job),
      state: job ? await job.getState() : null,
      returnvalue: job ? job.returnvalue : null,
      attemptsMade: job ? job.attemptsMade : null,
    });
  }
  await q.close();
}

function connect(url) {
  const cluster = 'redis+cluster://';
  if (!url.startsWith(cluster)) return new IORedis(url, { maxRetriesPerRequest: null });
  const nodes = url
    .slice(cluster.length)
    .replace(/\/.*$/, '')
    .split(',')
    .map((hostPort) => {
      const at = hostPort.lastIndexOf(':');
      return { host: hostPort.slice(0, at), port: Number(hostPort.slice(at + 1)) };
    });
  return new IORedis.Cluster(nodes, { redisOptions: { maxRetriesPerRequest: null } });
}

async function main() {
  const [command, url, prefix, queue, ...rest] = process.argv.slice(2);
  const connection = connect(url);
  try {
    if (command === 'work') await work(connection, prefix, queue, Number(rest[0]));
    else if (command === 'add') await add(connection, prefix, queue, Number(rest[0]));
    else if (command === 'ids') await ids(connection, prefix, queue, rest);
    else if (command === 'inspect') await inspect(connection, prefix, queue, rest);
    else throw new Error(`unknown command ${command}`);
  } finally {
    await connection.quit();
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
    process.exit(1);
  },
);
