package cdclake;

import de.bwaldvogel.mongo.MongoServer;
import de.bwaldvogel.mongo.backend.AbstractMongoBackend;
import de.bwaldvogel.mongo.backend.h2.H2Backend;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.oplog.Oplog;
import java.net.InetSocketAddress;
import org.h2.mvstore.MVStore;
import java.util.concurrent.CountDownLatch;

/**
 * Starts mongo-java-server with its oplog enabled (change streams need it; the library's own main does not enable
 * it) on a loopback address: the in-memory backend, or with FILE the H2 MVStore backend keeping every collection and
 * the oplog in that file across restarts (the demo's server: its lake mirrors stay valid when the demo restarts).
 *
 * <p>Usage: {@code java -cp '.jars/mongo-test-server/*' cdclake.MongoTestServer [HOST [PORT [FILE]]]}; HOST defaults
 * to 127.0.0.1 and PORT to 0 (a free port). Once bound, prints exactly one line {@code listening HOST:PORT} on stdout
 * with the bound port. Runs until the JVM is asked to stop (SIGTERM, SIGINT): a shutdown hook then closes the server
 * (and the file, committed). The server logs warnings and errors on stderr (more with
 * {@code -Dorg.slf4j.simpleLogger.defaultLogLevel=info}). Without FILE all data is gone when the process ends.
 * Either backend logs an insert in its oplog only when the document was stored ({@link StoredInsertsOplog}).
 *
 * <p>The file is opened with H2's background compaction off ({@code autoCompactFillRate(0)}: H2 2.3.232's
 * housekeeping then neither moves nor rewrites chunks; the library opens it with the default, 90%). That compaction
 * failed twice under the demo's load ({@code MVStoreException: Can not compare} in {@code FileStore.compactRewrite})
 * and closed the store for good. Space that no version uses any more is still freed and reused; the file is not
 * shrunk. Closing commits and does not compact either.
 */
public final class MongoTestServer {
  private MongoTestServer() {}

  public static void main(String[] args) throws InterruptedException {
    if (args.length > 3) {
      System.err.println("usage: cdclake.MongoTestServer [HOST [PORT [FILE]]]");
      System.exit(2);
    }
    if (System.getProperty("org.slf4j.simpleLogger.defaultLogLevel") == null) {
      System.setProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn");
    }
    String host = args.length > 0 ? args[0] : "127.0.0.1";
    int port = args.length > 1 ? Integer.parseInt(args[1]) : 0;

    AbstractMongoBackend backend =
        args.length > 2
            ? new H2Backend(openWithoutCompaction(args[2])) {
              @Override
              protected Oplog createOplog() {
                return new StoredInsertsOplog(super.createOplog(), this);
              }
            }
            : new MemoryBackend() {
              @Override
              protected Oplog createOplog() {
                return new StoredInsertsOplog(super.createOplog(), this);
              }
            };
    backend.enableOplog();
    MongoServer server = new MongoServer(backend);
    server.bind(host, port);
    InetSocketAddress address = server.getLocalAddress();

    CountDownLatch stopped = new CountDownLatch(1);
    Runtime.getRuntime()
        .addShutdownHook(
            new Thread(
                () -> {
                  server.shutdownNow();
                  stopped.countDown();
                },
                "mongo-test-server-shutdown"));
    System.out.println("listening " + host + ":" + address.getPort());
    System.out.flush();
    stopped.await();
  }

  /** The store H2Backend(String) opens ({@code MVStore.open(file)}), with background compaction off. */
  static MVStore openWithoutCompaction(String file) {
    return new MVStore.Builder().fileName(file).autoCompactFillRate(0).open();
  }
}
